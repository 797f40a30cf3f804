"""One masked-LM experiment: the BERT's shape, the data and the training that the demo
(:class:`numscope.demo.main.DemoConfig`) and the plan study (:class:`numscope.study.PlanStudyConfig`) both
train, written once, so that the study needs nothing from the demo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from numscope.observe import DEFAULT_CANDIDATES
from numscope.run.config import RunData, TrainConfig
from numscope.run.data import load_run_data
from numscope.run.model import ModelConfig

__all__ = ["Experiment", "experiment_observer"]


def _demo_training() -> TrainConfig:
    return TrainConfig(
        steps=400,
        batch_size=64,
        lr=1.5e-3,
        warmup_steps=30,
        eval_every=100,
        checkpoint_every=50,
        mask_probability=0.3,
    )


@dataclass(frozen=True)
class Experiment:
    """A BERT masked LM trained on a corpus: its shape, its data and its training.

    Sizes in tokens and elements; ``observe_every`` in optimizer steps. The defaults are the demo's, chosen
    by FP32 runs on this corpus so that FP32 learns context well below the context-free loss while the whole
    demo stays within ten minutes: docs/results/demo.md ("The demo's size") has every measurement and its
    noise.
    """

    train: TrainConfig = field(default_factory=_demo_training)
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 256
    dropout: float = 0.0
    seq_len: int = 32
    vocab_size: int = 2000
    max_train_blocks: int | None = None
    val_blocks: int = 2048
    observe_every: int = 50
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES

    def data(
        self, text_paths: Sequence[Path] | None = None, cache_dir: Path | None = None, progress: bool = False
    ) -> RunData:
        """Corpus → train/validation split → WordPiece tokenizer (cached) → token blocks (cached)."""
        return load_run_data(
            self.vocab_size,
            self.seq_len,
            self.val_blocks,
            text_paths,
            cache_dir,
            self.max_train_blocks,
            progress,
        )

    def model_config(self, data: RunData) -> ModelConfig:
        """The BERT of this shape for ``data``'s tokenizer, initialised from the training seed."""
        return ModelConfig(
            vocab_size=data.tokenizer.vocab_size,
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            intermediate=self.intermediate,
            max_position=self.seq_len,
            dropout=self.dropout,
            pad_token_id=data.tokenizer.pad_id,
            seed=self.train.seed,
        )


def experiment_observer(model: nn.Module, config: Experiment) -> Any:
    """An entered observer of ``model`` measuring every ``observe_every``-th training step (from step 0) in
    the experiment's candidates; the evaluations ``train_run`` makes run under ``torch.no_grad()`` and are
    not measured. A module-level function, so that a run in another process can be given it."""
    from numscope.observe import observe

    return observe(model, candidates=list(config.candidates), every=config.observe_every).__enter__()
