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
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from numscope import distributed
from numscope._atomic import atomic_write_text
from numscope._device import model_device, resolve_device, to_device
from numscope.convert import load_numerics_state_dict, numerics_state_dict, site_sizes
from numscope.run.config import RunData, RunError, RunResult, RunSpec, TrainConfig, read_result
from numscope.run.data import num_batches
from numscope.run.objectives import Objective, get_objective
from numscope.sites import sites
from numscope.train.adaptive import Adapter, AdaptiveConfig, observer_for, write_history
from numscope.train.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from numscope.train.loss_scaler import LossScaler
from numscope.train.optim import AdamW4bit, AdamW8bit, AdamWFp8
from numscope.train.recipe import Recipe

if TYPE_CHECKING:  # the model module imports transformers; train_run imports it when it needs it
    from numscope.run.model import ModelConfig


class _Batches:
    """The batch of a global step: a pure function of (seed, step), so a resumed run sees the same data.

    One epoch of batches is built at a time and kept until the next epoch starts.
    """

    def __init__(self, data: RunData, cfg: TrainConfig, objective: Objective) -> None:
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


def _train_settings(
    spec: RunSpec, cfg: TrainConfig, adaptive: AdaptiveConfig | None = None
) -> dict[str, Any]:
    """What a run computes besides its plan (``train.json``): the training settings, the loss scaling and,
    for an adaptive run, its settings."""
    settings = {**asdict(cfg), "loss_scaling": spec.loss_scaling, "init_scale": spec.init_scale}
    for where in ("device", "parallel"):  # where and how it runs, not what: a run may resume elsewhere
        del settings[where]
    if adaptive is not None:
        settings["adaptive"] = adaptive.to_dict()
    return json.loads(json.dumps(settings))  # tuples as lists, as stored


def _stored_changes(out_dir: Path, plan: Any, settings: dict[str, Any]) -> list[str]:
    """How the run stored in ``out_dir`` (its ``plan.yaml`` and ``train.json``) differs from ``plan`` and
    ``settings``; empty when nothing is stored or nothing differs (a setting the stored file lacks, from
    an older numscope, is not compared)."""
    from numscope.plan import Plan
    from numscope.run.folders import setting_changes

    changes = []
    stored_plan = out_dir / "plan.yaml"
    if stored_plan.is_file() and Plan.load(stored_plan).to_dict() != plan.to_dict():
        changes.append("plan: another plan (plan.yaml)")
    stored_cfg = out_dir / "train.json"
    if stored_cfg.is_file():
        before = json.loads(stored_cfg.read_text(encoding="utf-8"))
        changes += [c for c in setting_changes(before, settings) if c.split(":")[0] in before]
    return changes


def _needs_sites(spec: RunSpec) -> bool:
    """Whether the run's plan still has to be resolved with the model's sites (a named recipe whose layer
    choice depends on them, not already resolved by the caller)."""
    from numscope.plan import Plan

    return spec.resolved is None and Plan.needs_sites(spec.plan)


def _move_aside(folder: Path) -> Path:
    """Rename ``folder`` to the first free ``<folder>.replaced-N``."""
    k = 1
    while (target := folder.with_name(f"{folder.name}.replaced-{k}")).exists():
        k += 1
    folder.rename(target)
    return target


def run_recipe(
    model: torch.nn.Module, plan: Any, scaler: LossScaler, seed: int, compiled: bool | str = "auto"
) -> Recipe:
    """The recipe a run trains ``model`` with (converting it): FP32 parameters, ops and activations; the
    plan's GEMM operands, the loss scale, and the plan's stochastic rounding seeded by ``seed`` (a generator
    on the model's device: its draws differ between the CPU and a GPU, see :mod:`numscope.formats.cast`)."""
    return Recipe(
        model,
        plan=plan,
        dtype=torch.float32,
        fp32_ops=False,
        activations=None,
        loss_scale=scaler,
        generator=torch.Generator(model_device(model)).manual_seed(seed),
        compiled=compiled,
    )


LOG_FIELDS = ["step", "lr", "loss", "scale", "skipped", "val_loss", "val_accuracy", "seconds"]


def train_run(
    spec: RunSpec,
    model_config: ModelConfig | Callable[[], torch.nn.Module],
    cfg: TrainConfig,
    data: RunData,
    out_dir: Path,
    on_step: Callable[[int, float], None] | None = None,
    observer_factory: Callable[[torch.nn.Module], Any] | None = None,
    *,
    objective: str | Objective = "mlm",
    save_model: bool = False,
    compiled: bool | str = "auto",
    replace_changed: bool = False,
    adaptive: AdaptiveConfig | None = None,
    save_optimizer: bool = False,
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
    save_optimizer: with ``save_model``, the optimizer's final state too (``model.pt``'s ``"optimizer"``:
        Adam's moments, what :func:`numscope.forecast.measure.adam_preconditioner` reads).
    compiled: whether the plan's quantizers run compiled (:func:`numscope.convert`'s ``compiled``).
    replace_changed: what to do with a folder holding a run (finished or not) of another plan or training
        configuration (the ``plan.yaml`` and ``train.json`` it wrote): False raises :class:`RunError`;
        True moves it aside (``<folder>.replaced-N``, nothing is deleted) and trains afresh. Such a run is
        never reused or resumed. A folder from before ``train.json`` existed is checked by its plan only.
    adaptive: train with adaptive precision (:mod:`numscope.train.adaptive`): the plan is the starting plan;
        the changes are written to ``plan_history.csv`` (also at each checkpoint), the plan that ran last to
        ``plan.final.yaml``, and ``adaptive.json`` holds the settings, the average bits over training (the
        result's ``avg_bits``) and the bits of each plan from the step it started. Not with
        ``observer_factory`` (the adaptive run observes itself).

    Under ``torch.distributed`` with more than one rank the run is DDP over the default group (``batch_size``
    is the global batch and must divide evenly); every rank returns the result, only rank 0 writes. An
    observer merges each sampled step across the ranks at ``step()`` (its default ``reduce_ranks``), so rank
    0's analysis is that of the whole batch.
    """
    objective = get_objective(objective).for_training(cfg.mask_probability)
    if adaptive is not None and observer_factory is not None:
        raise RunError("an adaptive run observes itself: give adaptive or observer_factory, not both")
    world = distributed.world_size()
    if cfg.batch_size % world:
        raise ValueError(f"batch size {cfg.batch_size} does not divide evenly over {world} ranks")
    device = resolve_device(cfg.device, field="TrainConfig.device")
    folder = _RunFolder(out_dir, world)
    model, plan = _open_run(spec, model_config, cfg, folder, adaptive, replace_changed, device)
    if folder.result.is_file():
        return read_result(folder.result)
    run = _Training.build(model, plan, spec, cfg, folder, observer_factory, adaptive, compiled, device)
    start, curve, elapsed = run.resume(folder)
    new_log = not folder.log.exists()
    avg_bits = None
    with folder.log.open("a", newline="") if folder.writer else open(os.devnull, "w") as log_file:
        log = csv.DictWriter(log_file, fieldnames=LOG_FIELDS)
        if new_log:
            log.writeheader()
        began = time.perf_counter() - elapsed
        data_batches = _Batches(data, cfg, objective)
        model.train()
        for step in range(start, cfg.steps):
            loss_value, row = run.step(step, data_batches, objective)
            if avg_bits is None:
                avg_bits = plan.average_bits(site_sizes(model))
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
            if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                log_file.flush()
                run.checkpoint(folder, step + 1, curve, time.perf_counter() - began)
    return run.finish(folder, cfg, curve, avg_bits, began, save_model, save_optimizer)


@dataclass
class _RunFolder:
    """A run's folder and the files it holds; ``writer``: whether this process writes them (rank 0)."""

    path: Path
    world: int

    def __post_init__(self) -> None:
        self.writer = distributed.rank() == 0
        self.result, self.checkpoint, self.log = (
            self.path / "result.json",
            self.path / "checkpoint.pt",
            self.path / "log.csv",
        )
        if self.writer:
            self.path.mkdir(parents=True, exist_ok=True)


def _open_run(
    spec: RunSpec,
    model_config: Any,
    cfg: TrainConfig,
    folder: _RunFolder,
    adaptive: AdaptiveConfig | None,
    replace_changed: bool,
    device: torch.device,
) -> tuple[torch.nn.Module | None, Any]:
    """The model (None for a finished run whose plan needs no sites) and the plan; a folder holding a run
    of other settings is refused, or moved aside with ``replace_changed``. Writes the plan and
    ``train.json`` where the run is to train."""
    from numscope.run.model import ModelConfig, bert_mlm_from_config

    def build() -> torch.nn.Module:
        torch.manual_seed(cfg.seed)
        made = bert_mlm_from_config(model_config) if isinstance(model_config, ModelConfig) else model_config()
        return made.to(device)

    # a finished run builds its model only where the plan's layer choice needs the model's sites (a recipe)
    model = None if folder.result.is_file() and not _needs_sites(spec) else build()
    plan = spec.load_plan(None if model is None else (site.name for site in sites(model)))
    settings = _train_settings(spec, cfg, adaptive)
    trained = folder.result.is_file() or folder.checkpoint.is_file()
    if trained and (changes := _stored_changes(folder.path, plan, settings)):
        if not replace_changed:
            raise RunError(
                f"{folder.path} holds a run trained with other settings ({'; '.join(changes[:3])}); it is "
                "not reused: choose another folder, or move this one aside to train it again"
            )
        if folder.writer:
            kept = _move_aside(folder.path)
            folder.path.mkdir(parents=True)
            said = "; ".join(changes[:3])
            print(f"{folder.path}: trained with other settings ({said}); kept as {kept.name}")
        if folder.world > 1:
            dist.barrier()
    if folder.result.is_file():
        return model, plan
    model = build() if model is None else model
    if folder.writer:
        plan.save(folder.path / "plan.yaml")
        atomic_write_text(folder.path / "train.json", json.dumps(settings, indent=1))
    return model, plan


@dataclass
class _Training:
    """What a run's steps change: the model (``trained``: what a step calls, its DDP or FSDP2 form), the
    recipe with its loss scaler, the optimizer, an observer and an adapter."""

    model: torch.nn.Module
    trained: torch.nn.Module
    plan: Any
    recipe: Any
    scaler: LossScaler
    optimizer: torch.optim.Optimizer
    parameters: list[torch.nn.Parameter]
    observer: Any
    adapter: Adapter | None
    adaptive: AdaptiveConfig | None
    cfg: TrainConfig
    spec: RunSpec
    device: torch.device
    world: int
    sharded: bool

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        plan: Any,
        spec: RunSpec,
        cfg: TrainConfig,
        folder: _RunFolder,
        observer_factory: Callable[[torch.nn.Module], Any] | None,
        adaptive: AdaptiveConfig | None,
        compiled: bool | str,
        device: torch.device,
    ) -> _Training:
        world = folder.world
        sharded = world > 1 and cfg.parallel == "fsdp2"
        # the observer attaches first, so that it sees each operand before the plan quantizes it
        observer = observer_factory(model) if observer_factory is not None else None
        if adaptive is not None:
            observer = observer_for(model, plan, adaptive).attach()
        scaler = LossScaler(
            init_scale=spec.init_scale,
            enabled=spec.loss_scaling != "none",
            dynamic=spec.loss_scaling == "dynamic",
        )
        recipe = run_recipe(model, plan, scaler, cfg.seed, compiled)
        trained = _parallel(model, world, cfg.parallel, device)  # FSDP2 shards before the optimizer sees them
        # the recipe keeps FP32 parameters as they are (they are their own master weights); FSDP2 replaced
        # them by their shards, which the optimizer and the clipping take
        parameters = list(model.parameters()) if sharded else recipe.parameters()
        low_bit = {"adamw_fp8": AdamWFp8, "adamw_8bit": AdamW8bit, "adamw_4bit": AdamW4bit}.get(cfg.optimizer)
        kind = torch.optim.AdamW if low_bit is None else low_bit
        optimizer: torch.optim.Optimizer = kind(parameters, lr=cfg.lr, weight_decay=cfg.weight_decay)
        adapter = Adapter(model, plan, adaptive, observer) if adaptive is not None else None  # type: ignore[arg-type]
        return cls(
            model, trained, plan, recipe, scaler, optimizer, parameters, observer, adapter, adaptive, cfg,
            spec, device, world, sharded,
        )  # fmt: skip

    def resume(self, folder: _RunFolder) -> tuple[int, list[dict[str, Any]], float]:
        """Restore the last checkpoint, if any (the step it was taken after, the evaluations so far, the
        training time so far); otherwise start the log afresh."""
        start, curve, elapsed = 0, [], 0.0
        if folder.checkpoint.is_file():
            state = load_checkpoint(folder.checkpoint)
            _load_states(self.model, self.optimizer, state, self.sharded)
            self.scaler.load_state_dict(state["scaler"])
            if self.observer is not None:
                self.observer.load_state_dict(state["observer"])
            if self.adapter is not None:  # before the numerics: saved under the plan the adapter holds
                self.adapter.load_state_dict(state["adaptive"])
            load_numerics_state_dict(self.model, state["numerics"])
            set_rng_state(state["rng"])
            start, curve, elapsed = state["step"], state["curve"], state["elapsed"]
            if folder.writer:
                _truncate_log(folder.log, start)
        elif folder.writer and folder.log.exists():
            folder.log.unlink()
        if self.world > 1:
            dist.barrier()  # every rank has read the checkpoint before rank 0 may replace it
        return start, curve, elapsed

    def step(self, step: int, batches: _Batches, objective: Objective) -> tuple[float, dict[str, Any]]:
        """One optimizer step (skipped by the loss scaler on inf/NaN gradients): the loss, and its log row
        without the evaluation and the time."""
        cfg, world = self.cfg, self.world
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        batch = to_device(batches.at(step), self.device)
        if world > 1:
            rank, rows = distributed.rank(), cfg.batch_size // world
            whole = objective.label_count(batch)
            batch = {name: value[rank * rows : (rank + 1) * rows] for name, value in batch.items()}
            # the model's loss is a mean over this rank's labels; weighted so that DDP's average over
            # ranks is the mean over the whole batch's labels, as one process would compute it
            loss = self.trained(**batch).loss * (objective.label_count(batch) * world / max(1, whole))
        else:
            loss = self.trained(**batch).loss
        self.recipe.backward(loss)
        self.recipe.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.parameters, cfg.grad_clip)
        skipped_before = self.scaler.skipped_steps
        scale = self.scaler.get_scale()
        self.recipe.step(self.optimizer)  # skipped on inf/NaN gradients; the scale updated; gradients zeroed
        if self.sharded:  # the recipe zeroes the parameters it was built with; FSDP2 replaced them
            self.optimizer.zero_grad(set_to_none=True)
        if self.observer is not None:
            self.observer.step()
        if self.adapter is not None:
            self.adapter.after_step(step)  # the changes apply from the next step on
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
            "skipped": int(self.scaler.skipped_steps > skipped_before),
            "val_loss": "",
            "val_accuracy": "",
        }
        return loss_value, row

    def checkpoint(self, folder: _RunFolder, step: int, curve: list[dict[str, Any]], elapsed: float) -> None:
        """``checkpoint.pt`` after ``step`` steps: everything a resumed run needs to continue bit for bit."""
        model_state, optimizer_state = _full_states(self.model, self.optimizer, self.sharded)  # collectives
        if not folder.writer:
            return
        if self.adapter is not None:
            write_history(folder.path / "plan_history.csv", self.adapter.history)
        save_checkpoint(
            folder.checkpoint,
            {
                "step": step,
                "model": model_state,
                "optimizer": optimizer_state,
                "scaler": self.scaler.state_dict(),
                "numerics": numerics_state_dict(self.model),
                "rng": rng_state(),
                **({"observer": self.observer.state_dict()} if self.observer is not None else {}),
                **({"adaptive": self.adapter.state_dict()} if self.adapter is not None else {}),
                "curve": curve,
                "elapsed": elapsed,
            },
        )

    def finish(
        self,
        folder: _RunFolder,
        cfg: TrainConfig,
        curve: list[dict[str, Any]],
        avg_bits: float | None,
        began: float,
        save_model: bool,
        save_optimizer: bool,
    ) -> RunResult:
        """The run's result, its analysis or plan history, its model (``save_model``), and the checkpoint
        removed."""
        if self.adapter is not None:
            avg_bits = self.adapter.average_bits(cfg.steps)
            if folder.writer:
                _write_adaptive(folder.path, self.adapter, self.adaptive, avg_bits)  # type: ignore[arg-type]
        elif self.observer is not None and folder.writer:
            self.observer.analysis().save(folder.path / "analysis")
        if self.observer is not None:
            self.observer.__exit__(None, None, None)
        # the largest parameter difference between ranks (a collective); FSDP2's ranks hold different shards
        divergence = (
            distributed.parameter_divergence(self.model) if self.world > 1 and not self.sharded else None
        )
        if save_model:
            model_state, optimizer_state = _full_states(self.model, self.optimizer, self.sharded)
        last = curve[-1]
        result = RunResult(
            name=self.spec.name,
            plan=self.spec.plan,
            loss_scaling=self.spec.loss_scaling,
            val_loss=last["val_loss"],
            val_accuracy=last["val_accuracy"],
            skipped_steps=self.scaler.skipped_steps,
            wall_seconds=time.perf_counter() - began,
            steps=cfg.steps,
            curve=curve,
            final_scale=self.scaler.get_scale(),
            avg_bits=avg_bits,
            world_size=self.world,
            rank_divergence=divergence,
            device=str(self.device),
        )
        if folder.writer:
            if save_model:
                kept = {"model": model_state}
                if save_optimizer:
                    kept["optimizer"] = optimizer_state
                save_checkpoint(folder.path / "model.pt", kept)
            atomic_write_text(folder.result, json.dumps(result.to_dict(), indent=1))
            if folder.checkpoint.exists():
                folder.checkpoint.unlink()
        if self.world > 1:
            dist.barrier()  # no rank leaves before rank 0 has written the result
        return result


def _parallel(model: torch.nn.Module, world: int, parallel: str, device: torch.device) -> torch.nn.Module:
    """What a step calls: ``model`` itself in one process; under torchrun a DDP wrapper (``parallel``
    ``ddp``) or ``model`` sharded in place by FSDP2 (``fsdp2``: every element of each ``nn.ModuleList``, a
    transformer's layers, is one unit, the rest of the model another)."""
    if world <= 1:
        return model
    if parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for layer in module:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_states(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state as one process's would be (FSDP2's shards gathered on every
    rank, a collective; on the CPU); unsharded, the plain ``state_dict()`` of each."""
    if not sharded:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def _load_states(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], sharded: bool
) -> None:
    """Load a checkpoint's full model and optimizer state (each rank its own shards under FSDP2)."""
    if not sharded:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )


def _write_adaptive(out_dir: Path, adapter: Adapter, config: AdaptiveConfig, avg_bits: float) -> None:
    """An adaptive run's files: ``plan_history.csv``, ``plan.final.yaml``, ``adaptive.json``."""
    write_history(out_dir / "plan_history.csv", adapter.history)
    adapter.current().save(out_dir / "plan.final.yaml")
    causes: dict[str, int] = {}
    for change in adapter.history:
        causes[change.cause] = causes.get(change.cause, 0) + 1
    summary = {
        "settings": config.to_dict(),
        "average_bits": avg_bits,
        "changes": causes,
        "bits_from_step": adapter.state_dict()["state"]["bit_steps"],
        "budget": adapter.state_dict()["state"]["budget"],
    }
    atomic_write_text(out_dir / "adaptive.json", json.dumps(summary, indent=1))


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
