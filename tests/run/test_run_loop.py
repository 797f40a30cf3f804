"""The training loop on its own (``numscope.run.loop.train_run``): a causal LM from a factory under a plan
with dynamic loss scaling, what a finished run folder gives back, and the errors of an unusable one."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from numscope.run.config import RunData, RunError, RunSpec, TrainConfig
from numscope.run.data import make_blocks
from numscope.run.loop import read_log, train_run
from numscope.run.tokenizer import TokenizerInfo
from tiny_models import tiny_gpt2

SEQ_LEN = 32


@pytest.fixture(scope="module")
def data(small_train: list[str], small_tokenizer: Tokenizer) -> RunData:
    blocks = make_blocks(small_train[:80], small_tokenizer, SEQ_LEN)
    return RunData(blocks[:-8], blocks[-8:], TokenizerInfo.from_tokenizer(small_tokenizer))


def gpt2_factory(vocab_size: int):
    def make():  # the loop seeds before it builds the model
        return tiny_gpt2(vocab_size=vocab_size, layers=1, positions=SEQ_LEN, impl=None, seed=None)

    return make


def test_a_causal_lm_trains_under_a_plan_and_a_finished_run_is_not_repeated(
    data: RunData, tmp_path: Path
) -> None:
    config = TrainConfig(steps=8, batch_size=8, lr=3e-3, warmup_steps=2, eval_every=4, checkpoint_every=4)
    spec = RunSpec("fp8", "fp8", loss_scaling="dynamic", init_scale=2.0**8)
    factory = gpt2_factory(data.tokenizer.vocab_size)
    result = train_run(spec, factory, config, data, tmp_path / "run", objective="clm", compiled=False)
    log = read_log(tmp_path / "run" / "log.csv")
    assert [row["step"] for row in log] == list(range(1, 9))
    assert log[-1]["loss"] < log[0]["loss"]  # it learns
    assert [point["step"] for point in result.curve] == [4, 8] and result.val_loss == result.curve[-1][
        "val_loss"
    ]
    assert result.avg_bits == 8.0 and result.final_scale >= 2.0**8  # fp8 operands; the scale never fell
    assert not (
        tmp_path / "run" / "checkpoint.pt"
    ).exists()  # a finished run keeps its result, not a checkpoint
    stored = json.loads((tmp_path / "run" / "result.json").read_text())
    assert stored["val_loss"] == result.val_loss and stored["plan"] == "fp8"

    def no_model():
        raise AssertionError("a finished run must not build its model again")

    again = train_run(spec, no_model, config, data, tmp_path / "run", objective="clm")
    assert again == result


def test_a_run_of_another_plan_or_training_is_never_reused(data: RunData, tmp_path: Path) -> None:
    config = TrainConfig(steps=2, batch_size=8, eval_every=2, checkpoint_every=2)
    factory = gpt2_factory(data.tokenizer.vocab_size)
    folder = tmp_path / "run"
    first = train_run(RunSpec("a", "bf16"), factory, config, data, folder, objective="clm", compiled=False)
    with pytest.raises(RunError, match=r"holds a run trained with other settings \(plan: another plan"):
        train_run(RunSpec("a", "fp8"), factory, config, data, folder, objective="clm", compiled=False)
    with pytest.raises(RunError, match=r"lr: 0\.002 → 0\.003"):
        train_run(RunSpec("a", "bf16"), factory, replace(config, lr=3e-3), data, folder, objective="clm")
    with pytest.raises(RunError, match='loss_scaling: "none" → "dynamic"'):
        train_run(RunSpec("a", "bf16", "dynamic"), factory, config, data, folder, objective="clm")
    assert train_run(RunSpec("a", "bf16"), factory, config, data, folder, objective="clm") == first
    # replace_changed: the old run is kept beside, the new plan is trained
    second = train_run(
        RunSpec("a", "fp8"),
        factory,
        config,
        data,
        folder,
        objective="clm",
        compiled=False,
        replace_changed=True,
    )
    assert second.avg_bits == 8.0 and first.avg_bits == 16.0
    kept = tmp_path / "run.replaced-1"
    assert json.loads((kept / "result.json").read_text())["val_loss"] == first.val_loss
    assert json.loads((folder / "result.json").read_text())["val_loss"] == second.val_loss
    # a folder from before train.json is checked by its plan only
    (folder / "train.json").unlink()
    assert (
        train_run(RunSpec("a", "fp8"), factory, replace(config, lr=3e-3), data, folder, objective="clm")
        == second
    )


def test_an_unusable_result_or_log_is_one_clear_error(data: RunData, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "result.json").write_text("{ not json")
    spec, config = RunSpec("fp32", "fp32"), TrainConfig(steps=1, batch_size=8)
    with pytest.raises(
        RunError, match=r"result\.json: not a readable run result .*delete it to run the run again"
    ):
        train_run(spec, gpt2_factory(data.tokenizer.vocab_size), config, data, folder, objective="clm")
    (folder / "log.csv").write_text("step,loss\nnot,a number\n")
    with pytest.raises(RunError, match="not a numscope training log"):
        read_log(folder / "log.csv")
    with pytest.raises(ValueError, match=r"batch size 512 exceeds the \d+ training blocks"):
        train_run(spec, gpt2_factory(data.tokenizer.vocab_size), TrainConfig(steps=1, batch_size=512), data,
                  tmp_path / "big", objective="clm")  # fmt: skip


def test_the_training_mask_probability_masks_that_share_and_evaluation_stays_at_15_percent(
    data: RunData, tmp_path: Path
) -> None:
    from numscope.run.objectives import MaskedLM, get_objective

    masked = {}
    for probability in (0.15, 0.4):
        objective = get_objective("mlm").for_training(probability)
        labels = torch.cat(
            [b["labels"] for b in objective.batches(data.train_blocks, 8, data.tokenizer, 0, 0)]
        )
        masked[probability] = (labels != -100).float().mean().item()
    assert abs(masked[0.15] - 0.15) < 0.03 and abs(masked[0.4] - 0.4) < 0.04
    assert get_objective("mlm").for_training(0.15) is get_objective("mlm")
    with pytest.raises(ValueError, match=r"mask probability must be in \(0, 1\]; got 0"):
        MaskedLM(0)
    with pytest.raises(ValueError, match="applies to the masked LM only; the clm objective masks nothing"):
        get_objective("clm").for_training(0.3)
    # the setting reaches the training loop: the same run at 40% trains differently
    from numscope.run.model import ModelConfig, bert_mlm_from_config

    model = ModelConfig(
        vocab_size=data.tokenizer.vocab_size, hidden=16, heads=2, intermediate=32, max_position=SEQ_LEN
    )
    config = TrainConfig(steps=2, batch_size=8, eval_every=2, checkpoint_every=2)
    runs = [
        train_run(RunSpec("m", "fp32"), model, replace(config, mask_probability=p), data, tmp_path / str(p))
        for p in (0.15, 0.4)
    ]
    assert runs[0].val_loss != runs[1].val_loss
    # evaluation scores the same 15% of the validation tokens whatever the training share
    bert = bert_mlm_from_config(model)
    scores = [MaskedLM(p).evaluate(bert, data.val_blocks, data.tokenizer, 0) for p in (0.15, 0.4)]
    assert scores[0] == scores[1] and scores[0].masked_tokens > 0
