"""Resolve once, then flow: a verb that trains several runs (band, localize, forecast, calibrate) finds the
model, settles the tokenizer, reads and hashes the corpus and makes the token blocks once, and its runs are
the runs a model spec gives."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from numscope.errors import WorkflowError
from numscope.run import runner, sources
from numscope.run.config import TrainConfig
from numscope.run.sources import DataSettings, Workload, resolve_workload


def _data(tmp_path: Path) -> DataSettings:
    from checkpoints import write_text

    text = write_text(tmp_path / "text.txt", paragraphs=120)
    return DataSettings(
        (str(text),), vocab_size=200, seq_len=32, val_blocks=16, cache_dir=str(tmp_path / "c")
    )


CONFIG = TrainConfig(steps=6, batch_size=8, warmup_steps=1, eval_every=6, checkpoint_every=6)


def test_a_band_resolves_its_model_and_data_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from numscope.diagnose import BandSettings, band

    calls = {"resolve_model": 0, "prepare_data": 0, "corpus_digest": 0}
    for name in calls:
        original = getattr(sources, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(sources, name, counted)
        if hasattr(runner, name):
            monkeypatch.setattr(runner, name, counted)
    data = _data(tmp_path)
    made = band(
        "tiny-bert", data, tmp_path / "band", plan="fp8", config=CONFIG, settings=BandSettings(seeds=2)
    )
    assert sorted(made.gaps) == [0, 1]  # four runs: FP32 and fp8 on two seeds
    assert calls == {"resolve_model": 1, "prepare_data": 1, "corpus_digest": 1}


def test_a_workload_trains_the_runs_a_model_spec_trains(tmp_path: Path) -> None:
    data = _data(tmp_path)
    work = resolve_workload("tiny-bert", data)
    assert isinstance(work, Workload) and resolve_workload(work) is work
    by_spec = runner.train("tiny-bert", data, tmp_path / "spec", plan="fp8", config=CONFIG)
    by_work = runner.train(work, None, tmp_path / "work", plan="fp8", config=CONFIG)
    assert by_work.val_loss == by_spec.val_loss
    spec_settings = json.loads((tmp_path / "spec" / "run.json").read_text())
    work_settings = json.loads((tmp_path / "work" / "run.json").read_text())
    assert spec_settings == {**work_settings, "name": spec_settings["name"]}
    with pytest.raises(WorkflowError, match="carries its own data"):
        resolve_workload(work, replace(data, seq_len=64))
    with pytest.raises(WorkflowError, match="`data` is needed"):
        resolve_workload("tiny-bert")
