"""What one training run is: its plan and loss scaling (:class:`RunSpec`), the optimisation settings
shared by an experiment's runs (:class:`TrainConfig`), the data it trains on (:class:`RunData`) and what a
finished run wrote (:class:`RunResult`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from numscope._device import DEVICES
from numscope._settings import setting
from numscope.errors import NumscopeError, SettingsError
from numscope.plan import Plan
from numscope.run.tokenizer import TokenizerInfo

LOSS_SCALING = ("none", "static", "dynamic")

SENSITIVITY_METHODS = ("local", "one_at_a_time")
"""How ``analyze`` measures the sensitivity (:data:`numscope.sensitivity.METHODS`)."""

SENSITIVITY_GRANULARITIES = ("operand", "site")


@dataclass(frozen=True)
class SensitivitySettings:
    """How :func:`numscope.run.analyze` measures each operand's (or site's) effect on the trained model's
    loss and gradient after its FP32 run (:func:`numscope.sensitivity`), stored with the analysis for
    ``recommend``'s sensitivity objective; ``numscope analyze``'s ``--sensitivity*`` flags set it, with these
    defaults.

    batches: validation batches measured on; None (default): ``AUTO_SENSITIVITY_BATCHES`` in one process,
        none under ``torchrun``; 0 skips the measurement.
    granularity: ``"operand"`` (what the sensitivity objective and a sensitivity gap model need) or
        ``"site"`` (a whole site at a time, a sixth of the passes).
    formats: the observed candidates measured: ``"auto"`` (the one with the fewest bits, from which
        :func:`numscope.advisor.operand_impact` estimates the others with the observer's noise ratios), None
        (all of them) or format names.
    early: a step whose model is kept too and measured beside the trained one (the two combined,
        :func:`numscope.sensitivity.combine_sensitivities`); ``"auto"``: ``AUTO_SENSITIVITY_EARLY`` where the
        run is long enough (``AUTO_EARLY_MIN_STEPS``); None: none. It doubles the measurement's cost.
    method: ``"local"`` (every operand and format from a few passes per batch,
        :func:`numscope.sensitivity.local_sensitivity`; operands only) or ``"one_at_a_time"`` (a pass per
        operand or site and format); None: local per operand, one at a time per site.
    kinds: the kinds of site measured (:mod:`numscope.sites`' kinds: ``linear``, ``matmul``, ``conv1d``,
        …); None (default): every kind. A plan for a training stack chooses only among the sites the stack
        converts (``numscope.plan.targets.LINEAR_KINDS``): the forecast measures those alone.
    stacks: training stacks (``te``, ``torchao``, ``megatron``); given, a Linear site whose weight shape
        none of these stacks' kernels can quantize in any of its recipes' formats is not measured
        (:func:`numscope.plan.export.shape_problem`; a vocabulary head of 30,527 rows: it stays high in
        every plan for those stacks, which therefore never ask its sensitivity); sites of other kinds are
        not concerned. None (default): no shape rule.
    """

    batches: int | None = None
    granularity: str = "operand"
    formats: tuple[str, ...] | str | None = "auto"
    early: int | str | None = None
    method: str | None = None
    kinds: tuple[str, ...] | None = None
    stacks: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.stacks is not None:
            from numscope.plan.targets import STACKS

            stacks = (self.stacks,) if isinstance(self.stacks, str) else self.stacks
            if (
                not isinstance(stacks, list | tuple)
                or not stacks
                or not all(isinstance(k, str) and k in STACKS for k in stacks)
            ):
                allowed = ", ".join(STACKS)
                raise SettingsError(f"{name}.stacks", f"stacks among {allowed}, or None; got {self.stacks!r}")
            object.__setattr__(self, "stacks", tuple(stacks))
        if self.kinds is not None:
            kinds = (self.kinds,) if isinstance(self.kinds, str) else self.kinds
            if not isinstance(kinds, list | tuple) or not kinds or not all(isinstance(k, str) for k in kinds):
                raise SettingsError(
                    f"{name}.kinds", f"site kinds (e.g. ('linear',)) or None; got {self.kinds!r}"
                )
            object.__setattr__(self, "kinds", tuple(kinds))
        batches = self.batches
        if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int) or batches < 0):
            raise SettingsError(
                f"{name}.batches", f"a number of batches >= 0 or None (auto); got {batches!r}"
            )
        if self.granularity not in SENSITIVITY_GRANULARITIES:
            raise SettingsError(
                f"{name}.granularity",
                f"{self.granularity!r} unknown; allowed: {', '.join(SENSITIVITY_GRANULARITIES)}",
            )
        formats = self.formats
        if isinstance(formats, list | tuple):
            if not formats or not all(isinstance(item, str) for item in formats):
                raise SettingsError(f"{name}.formats", f"format names, 'auto' or None (all); got {formats!r}")
            object.__setattr__(self, "formats", tuple(formats))
        elif formats is not None and not isinstance(formats, str):
            raise SettingsError(f"{name}.formats", f"format names, 'auto' or None (all); got {formats!r}")
        early = self.early
        if (
            early is not None
            and early != "auto"
            and (isinstance(early, bool) or not isinstance(early, int) or early < 1)
        ):
            raise SettingsError(f"{name}.early", f"a step >= 1, 'auto' or None; got {early!r}")
        if self.method is not None and self.method not in SENSITIVITY_METHODS:
            raise SettingsError(
                f"{name}.method", f"{self.method!r} unknown; allowed: {', '.join(SENSITIVITY_METHODS)}"
            )
        if self.method == "local" and self.granularity != "operand":
            raise SettingsError(
                f"{name}.method",
                "'local' measures every operand; with granularity 'site' use method 'one_at_a_time'",
            )

    @property
    def resolved_method(self) -> str:
        """The method measured with: :attr:`method`, or the default for the granularity."""
        if self.method is not None:
            return self.method
        return "local" if self.granularity == "operand" else "one_at_a_time"


@dataclass(frozen=True)
class RunSpec:
    """What differs between the demo's runs: the plan and the loss scaling."""

    name: str
    plan: str  # a preset or recipe name (Plan.named) or a path to a plan YAML
    loss_scaling: str = "none"
    init_scale: float = 2.0**16
    description: str = ""
    #: the plan ``plan`` names, already resolved with the model's sites (numscope.run.runner.train resolves
    #: it once and records it); None: :meth:`load_plan` resolves it
    resolved: Plan | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.loss_scaling not in LOSS_SCALING:
            raise ValueError(
                f"loss_scaling {self.loss_scaling!r} unknown; allowed: {', '.join(LOSS_SCALING)}"
            )

    def load_plan(self, sites: Iterable[str] | None = None) -> Plan:
        """The plan: :attr:`resolved` when given, else a YAML file, a preset or a named recipe (given the
        model's ``sites`` where the recipe's layer choice needs them)."""
        return self.resolved if self.resolved is not None else Plan.resolve(self.plan, sites)


PARALLEL = ("ddp", "fsdp2")
"""How ranks under torchrun share a run: ``torch.nn.parallel.DistributedDataParallel`` or FSDP2
(``torch.distributed.fsdp.fully_shard``)."""

OPTIMIZERS = ("adamw", "adamw_fp8", "adamw_8bit", "adamw_4bit")
"""``adamw``: ``torch.optim.AdamW``; ``adamw_fp8``, ``adamw_8bit``, ``adamw_4bit``:
:class:`numscope.train.AdamWFp8`, ``AdamW8bit``, ``AdamW4bit`` (moments in FP8, 8-bit or 4-bit blocks)."""


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings shared by every run of one experiment (units: steps, tokens, nats)."""

    steps: int = setting(300, "optimizer steps", minimum=1)
    batch_size: int = setting(32, "sequences per step, over all processes under torchrun", minimum=1)
    lr: float = setting(2e-3, "peak AdamW learning rate", positive=True)
    warmup_steps: int = setting(30, "linear warm-up steps, then cosine decay to 10% of `lr`", minimum=0)
    weight_decay: float = setting(0.01, "AdamW weight decay", minimum=0)
    grad_clip: float = setting(1.0, "clip the gradient's global norm to this, after unscaling", positive=True)
    eval_every: int = setting(50, "validate every this many steps, and after the last", minimum=1)
    checkpoint_every: int = setting(
        50, "write checkpoint.pt (atomically) every this many steps; a rerun resumes from it", minimum=1
    )
    seed: int = setting(0, "seed of initialisation, data order and masks")
    optimizer: str = setting(
        "adamw",
        "adamw (torch.optim.AdamW), adamw_fp8 or adamw_8bit (its moments in FP8 or 8-bit dynamic-map blocks, "
        "as torchao's AdamWFp8 and AdamW8bit: a quarter of the optimizer's memory) or adamw_4bit (4-bit "
        "blocks, as torchao's AdamW4bit: an eighth)",
        choices=OPTIMIZERS,
    )
    mask_probability: float = setting(
        0.15,
        "masked LM: share of each training block's tokens masked (80/10/10); evaluation masks 15% always, so "
        "validation losses compare across settings",
        positive=True,
    )
    device: str = setting(
        "auto",
        "where to train and measure: auto (a GPU where torch sees one, else the CPU), cpu, or cuda (under "
        "torchrun, each process's own GPU, ranks joined over NCCL)",
        choices=DEVICES,
    )
    parallel: str = setting(
        "ddp",
        "under torchrun with more than one process: ddp (every rank holds the whole model) or fsdp2 "
        "(parameters, gradients and optimizer state sharded over the ranks: a model too large for one "
        "device)",
        choices=PARALLEL,
    )

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.device not in DEVICES:
            raise SettingsError(
                "TrainConfig.device", f"{self.device!r} unknown; allowed: {', '.join(DEVICES)}"
            )
        if self.parallel not in PARALLEL:
            raise SettingsError(
                "TrainConfig.parallel", f"{self.parallel!r} unknown; allowed: {', '.join(PARALLEL)}"
            )

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
    device: str = "cpu"  # where it trained (rank 0's device)
    rank_divergence: float | None = None  # largest parameter difference between ranks at the end (DDP only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunError(NumscopeError, ValueError):
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
class RunData:
    train_blocks: torch.Tensor
    val_blocks: torch.Tensor
    tokenizer: TokenizerInfo
