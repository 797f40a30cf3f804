"""The plan study's settings and vocabulary: plan families, heuristics, uniform formats, the win rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from numscope.errors import NumscopeError
from numscope.plan import OperandSpec, Plan

FAMILIES: tuple[str, ...] = (
    "reference",
    "uniform",
    "calibration",
    "numscope",
    "heuristic",
    "random",
    "inverse",
)
HEURISTICS: tuple[str, ...] = ("first/last layers", "last layers", "wgrad high", "gradients high")
UNIFORM: tuple[str, ...] = ("bf16", "fp8", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
_SHARED_WITH_EXPERIMENT = (
    "hidden", "layers", "heads", "intermediate", "seq_len", "vocab_size", "observe_every", "val_blocks",
)  # fmt: skip
"""The fields a study and its :class:`numscope.run.experiment.Experiment` hold alike (the training differs:
the study keeps steps, batch, lr, masking and warm-up flat)."""

RESULT_NEUTRAL = ("budgets", "seeds", "random_plans", "uniform", "jobs")
"""Settings that choose which runs the study makes, not what a (plan, seed) run computes: a rerun with other
values reuses every finished run."""
WIN_SIGMAS = 2.0
"""A paired difference counts as a win when its mean exceeds this many standard deviations of it."""


class StudyError(NumscopeError, ValueError):
    """Settings the plan study cannot run with."""


DEMO_MODEL_STEPS = 1000
"""The steps of :meth:`PlanStudyConfig.demo_model`: the demo's length when the study's tables on its model
were made (docs/results/plan-study.md)."""


@dataclass(frozen=True)
class PlanStudyConfig:
    """What the study trains: the demo's BERT knobs and training; budgets in bits per operand element;
    ``jobs`` runs train side by side in processes of one thread each.

    The defaults were chosen by FP32 runs so that every seed leaves the context-free plateau early and the
    whole study stays under an hour on two cores: docs/results/plan-study.md ("The study's size")."""

    budgets: tuple[float, ...] = (5.0, 6.0, 7.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    random_plans: int = 5
    low: str = "mxfp4_e2m1"
    high: str = "mxfp8_e4m3"
    uniform: tuple[str, ...] = UNIFORM
    jobs: int = 2
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    intermediate: int = 512
    seq_len: int = 128
    vocab_size: int = 1000
    observe_every: int = 25
    val_blocks: int = 256
    mask_probability: float = 0.15
    warmup_steps: int | None = None
    """None: a sixteenth of the steps."""
    target: str | None = None
    """A training stack (``te``, ``torchao``, ``megatron``; :mod:`numscope.plan.targets`): numscope's plan
    is also made for it at every budget (``numscope TARGET@B``: only what that stack runs, by the noise
    objective, within its own range of bits: :func:`numscope.study.plans.target_budget`), and the FP32
    run observes the formats its recipes use. None: no target plan."""

    @classmethod
    def quick(cls) -> PlanStudyConfig:
        return cls(
            budgets=(6.0,),
            seeds=(0, 1),
            random_plans=2,
            uniform=("mxfp8", "mxfp4"),
            steps=40,
            hidden=64,
            intermediate=128,
            seq_len=64,
            observe_every=10,
        )

    @classmethod
    def demo_model(cls) -> PlanStudyConfig:
        """The demo's model and training (:class:`numscope.run.experiment.Experiment`'s defaults: vocabulary
        2,000, 32-token blocks, AdamW steps of 64 blocks at lr 1.5e-3, 4 heads, FFN 256, 30% of tokens
        masked in training, 2,048 validation blocks), on which FP32 learns further below the context-free
        loss than on the study's own default model (docs/results/demo.md), for ``DEMO_MODEL_STEPS`` steps: the
        length the study's tables on this model were made with (the demo itself trains fewer since it was
        cut to fit ten minutes). The study's plans, budgets and seeds are unchanged."""
        from numscope.run.experiment import Experiment

        demo = Experiment()
        return cls(
            steps=DEMO_MODEL_STEPS,
            batch_size=demo.train.batch_size,
            lr=demo.train.lr,
            mask_probability=demo.train.mask_probability,
            warmup_steps=demo.train.warmup_steps,
            **{name: getattr(demo, name) for name in _SHARED_WITH_EXPERIMENT},
        )

    def check(self) -> None:
        if len(set(self.seeds)) != len(self.seeds) or not self.seeds:
            raise StudyError(f"seeds must be distinct and at least one; got {list(self.seeds)}")
        low, high = (OperandSpec(label).bits_per_element() for label in (self.low, self.high))
        for budget in self.budgets:
            if not low <= budget <= high:
                raise StudyError(
                    f"budget {budget:g} must lie between {self.low} ({low:g} bits) and {self.high} "
                    f"({high:g} bits)"
                )
        if self.jobs < 1 or self.random_plans < 0:
            raise StudyError(f"jobs must be >= 1 and random_plans >= 0; got {self.jobs}, {self.random_plans}")
        for name in self.uniform:
            Plan.named(name)
        if self.target is not None:
            from numscope.plan.targets import STACKS as stacks

            if self.target not in stacks:
                raise StudyError(f"target {self.target!r}: unknown; allowed: {', '.join(stacks)}")

    def target_formats(self) -> tuple[str, ...]:
        """The formats the target's recipes are measured in (none without a target)."""
        if self.target is None:
            return ()
        from numscope.plan.targets import get_target

        return tuple(dict.fromkeys(f for recipe in get_target(self.target).recipes for f in recipe.measured))

    def experiment(self, seed: int) -> Any:
        """The :class:`numscope.run.experiment.Experiment` one run of the study trains (from ``seed``)."""
        from numscope.run.config import TrainConfig
        from numscope.run.experiment import Experiment

        train = TrainConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            warmup_steps=self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 16),
            eval_every=max(1, self.steps // 10),
            checkpoint_every=max(1, self.steps // 5),
            seed=seed,
            mask_probability=self.mask_probability,
        )
        candidates = tuple(dict.fromkeys((self.low, self.high, *UNIFORM_CANDIDATES, *self.target_formats())))
        return Experiment(
            train=train,
            candidates=candidates,
            **{name: getattr(self, name) for name in _SHARED_WITH_EXPERIMENT},
        )


UNIFORM_CANDIDATES = (
    "bf16",
    "fp16",
    "fp8_e4m3",
    "fp8_e5m2",
    "mxfp8_e4m3",
    "mxfp6_e3m2",
    "mxfp4_e2m1",
    "nvfp4",
)
"""What the FP32 run measures: every format the uniform plans use (their predicted gaps need them)."""
