"""The training-framework callbacks with the real frameworks: a Hugging Face Trainer and a Lightning Trainer
train a tiny model a few steps, observed; the analysis they write feeds recommend; a plan converts."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import BertForMaskedLM, Trainer, TrainingArguments

import numscope
from numscope.analysis import Analysis
from tiny_models import tiny_bert

CANDIDATES = ["bf16", "fp8_e4m3", "fp8_e5m2"]


def bert() -> BertForMaskedLM:
    return tiny_bert(layers=1, impl=None)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, count: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 100, (count, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def hf_trainer(model, out, callback, steps: int = 4, accumulation: int = 1) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=Blocks(), callbacks=[callback])


def test_huggingface_trainer_is_observed_and_the_analysis_feeds_recommend(tmp_path) -> None:
    from numscope.integrations.huggingface import NumscopeCallback

    callback = NumscopeCallback(tmp_path / "analysis", candidates=CANDIDATES, every=2)
    hf_trainer(bert(), tmp_path / "hf", callback, steps=5, accumulation=2).train()
    analysis = Analysis.load(tmp_path / "analysis")
    assert analysis.steps == [0, 2, 4]  # one observer step per optimizer step, accumulation included
    assert "bert.encoder.layer.0.attention.self.query" in analysis.sites()
    assert callback.analysis is not None and callback.analysis.steps == analysis.steps
    plan = numscope.recommend(analysis, candidates=CANDIDATES)
    model = bert()
    hf_trainer(model, tmp_path / "planned", NumscopeCallback(plan=plan, observe=False), steps=2).train()
    from numscope.convert import converted_plan

    assert converted_plan(model) == plan


def test_huggingface_callback_trains_under_a_named_recipe(tmp_path) -> None:
    from numscope.integrations.huggingface import NumscopeCallback

    model, reference = bert(), bert()
    hf_trainer(model, tmp_path / "a", NumscopeCallback(plan="te_current", observe=False), steps=2).train()
    hf_trainer(reference, tmp_path / "b", NumscopeCallback(plan="fp32", observe=False), steps=2).train()
    weight = "bert.encoder.layer.0.intermediate.dense.weight"
    assert not torch.equal(model.state_dict()[weight], reference.state_dict()[weight])  # fp8 changed it
    with pytest.raises(ValueError, match="with observe=False needs a plan"):
        NumscopeCallback(observe=False)


def test_huggingface_callback_trains_with_adaptive_precision(tmp_path) -> None:
    """The adaptive mode through the Trainer: one decision per optimizer step (gradient accumulation
    included), the history and the final plan written where training ends, the model under that plan."""
    from numscope.convert import converted_plan
    from numscope.integrations.huggingface import NumscopeCallback
    from numscope.plan import Plan
    from numscope.train.adaptive import AdaptiveConfig, read_history

    adaptive = AdaptiveConfig(every=1, replan_every=1, patience=1, candidates=tuple(CANDIDATES))
    model = bert()
    callback = NumscopeCallback(tmp_path / "adaptive", plan="fp8", adaptive=adaptive)
    hf_trainer(model, tmp_path / "hf", callback, steps=3, accumulation=2).train()
    history = read_history(tmp_path / "adaptive" / "plan_history.csv")
    assert history == callback.numerics.adapter.history and history
    assert max(change.step for change in history) <= 3  # three optimizer steps, six micro-batches
    assert Plan.load(tmp_path / "adaptive" / "plan.final.yaml") == converted_plan(model)
    with pytest.raises(ValueError, match="starts from a plan"):
        NumscopeCallback(adaptive=adaptive)


def test_lightning_trainer_is_observed(tmp_path) -> None:
    lightning = pytest.importorskip("lightning")
    from numscope.integrations.lightning import NumscopeLightningCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = bert()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callback = NumscopeLightningCallback(tmp_path / "analysis", candidates=CANDIDATES, every=2)
    trainer = lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader(Blocks(), batch_size=4)
    trainer.fit(Module(), loader)
    analysis = Analysis.load(tmp_path / "analysis")
    assert analysis.steps == [0, 2]
    assert "bert.encoder.layer.0.output.dense" in analysis.sites()  # the module training_step calls


@pytest.mark.slow  # two fresh interpreters importing transformers and lightning
@pytest.mark.parametrize("example", ["hf_trainer.py", "lightning_train.py"])
def test_the_framework_examples_run(example: str, tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / example
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert Analysis.load(tmp_path / "out" / "analysis").steps == [0, 4]
