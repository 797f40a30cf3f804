"""FP32 and a plan in lockstep: identical starts, batches and dropout draws; the drift and the error each
site's casts add, step by step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numscope.diagnose import lockstep
from numscope.plan import Plan


def _setup(tmp_path: Path, steps: int = 4):
    from checkpoints import write_text
    from numscope.run import runner
    from numscope.run.config import TrainConfig
    from numscope.run.loop import _Batches
    from numscope.run.objectives import get_objective
    from numscope.run.sources import DataSettings

    text = write_text(tmp_path / "text.txt", paragraphs=60)
    data = DataSettings(text=(str(text),), vocab_size=150, seq_len=16, val_blocks=8, cache_dir=str(tmp_path))
    config = TrainConfig(steps=steps, batch_size=4, warmup_steps=1)
    prepared, factory, objective = runner.prepare("tiny-bert", data, config)  # dropout 0.1: drawn alike
    batches = _Batches(prepared, config, get_objective(objective).for_training(config.mask_probability))
    return factory, batches.at, config


def _run(tmp_path: Path, plan: Plan, steps: int = 4, every: int = 1):
    factory, batch_at, config = _setup(tmp_path, steps)
    return lockstep(
        factory,
        plan,
        batch_at,
        steps=steps,
        seed=0,
        lr_at=config.lr_at,
        weight_decay=config.weight_decay,
        grad_clip=config.grad_clip,
        every=every,
    )


def test_fp32_against_fp32_drifts_nowhere(tmp_path: Path) -> None:
    drift = _run(tmp_path, Plan.uniform("fp32"))
    assert drift.steps == [1, 2, 3, 4] and drift.loss_reference == drift.loss_plan
    for figure in ("input", "grad_output", "weight"):
        assert all(value == 0.0 for row in drift.figures[figure] for value in row), figure
    assert all(value is None for row in drift.figures["local"] for value in row)  # nothing cast
    assert "bert.encoder.layer.0.attention.self.scores" in drift.sites


def test_a_plan_adds_error_where_it_casts_and_drift_follows_from_the_first_update(tmp_path: Path) -> None:
    plan = Plan.uniform("fp8").with_rule("cls.*", Plan.uniform("fp32").default)  # the head kept high
    drift = _run(tmp_path, plan, steps=3)
    first = {site: k for k, site in enumerate(drift.sites)}
    query, head = first["bert.encoder.layer.0.attention.self.query"], first["cls.predictions.decoder"]
    step_one = {figure: rows[0] for figure, rows in drift.figures.items()}
    assert step_one["input"][query] == 0.0 and step_one["weight"][query] == 0.0  # same start, same batch
    # the head's incoming gradient differs only through the logits the cast layers below changed; the first
    # layer's has passed backward through every cast layer above it
    assert 0.0 < step_one["grad_output"][head] < step_one["grad_output"][query]
    assert 0.01 < step_one["local"][query] < 0.2 and step_one["local"][head] is None
    assert all(row[query] > 0.0 for row in drift.figures["weight"][1:])  # after the first update
    assert set(drift.operand_local[drift.sites[query]]) == {"input", "weight", "grad_output"}
    again = type(drift).from_dict(drift.to_dict())
    assert again.to_dict() == drift.to_dict()


def test_steps_between_records_are_trained_but_not_compared(tmp_path: Path) -> None:
    drift = _run(tmp_path, Plan.uniform("fp8"), steps=5, every=2)
    assert drift.steps == [2, 4, 5] and len(drift.loss_plan) == 5
    assert all(len(rows) == 3 for rows in drift.figures.values())


def test_a_factory_that_builds_other_weights_from_one_seed_is_refused(tmp_path: Path) -> None:
    factory, batch_at, config = _setup(tmp_path)
    calls = []

    def drifting() -> torch.nn.Module:
        calls.append(1)
        model = factory()
        if len(calls) == 2:
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        return model

    with pytest.raises(ValueError, match="does not build the same weights twice"):
        lockstep(drifting, Plan.uniform("fp8"), batch_at, steps=1, seed=0, lr_at=config.lr_at,
                 weight_decay=0.0, grad_clip=1.0)  # fmt: skip
