"""The run's settings objects (TrainConfig, DataSettings) are checked against the bounds their flags carry
(``numscope._settings.check_settings``): a wrong value is a SettingsError named as the Python API names it,
and the command line prints it under the flag that sets it, for every generated flag."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from numscope._settings import check_settings, flag_of
from numscope.cli import _under_its_flag
from numscope.cli.runs import SETTING_FLAGS
from numscope.errors import SettingsError
from numscope.run.config import TrainConfig
from numscope.run.sources import DataSettings
from numscope.train.adaptive import AdaptiveConfig


@pytest.mark.parametrize(
    ("given", "setting"),
    [
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"batch_size": True}, "batch_size"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"grad_clip": float("inf")}, "grad_clip"),
        ({"mask_probability": 0.0}, "mask_probability"),
    ],
)
def test_a_train_setting_out_of_bounds_is_named(given: dict, setting: str) -> None:
    with pytest.raises(SettingsError) as raised:
        check_settings(TrainConfig(**given))
    assert raised.value.setting == f"TrainConfig.{setting}"


def test_the_defaults_pass() -> None:
    check_settings(TrainConfig())
    check_settings(AdaptiveConfig())


@pytest.mark.parametrize(
    ("given", "setting"), [({"seq_len": 2}, "seq_len"), ({"vocab_size": 5}, "vocab_size")]
)
def test_a_data_setting_out_of_bounds_is_named(tmp_path: Path, given: dict, setting: str) -> None:
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    with pytest.raises(SettingsError) as raised:
        DataSettings(text=str(text), **given)
    assert raised.value.setting == f"DataSettings.{setting}"


def test_the_command_line_names_every_generated_setting_by_its_flag() -> None:
    for cls in (TrainConfig, DataSettings, AdaptiveConfig):
        for item in fields(cls):
            if "help" in item.metadata:
                assert SETTING_FLAGS[f"{cls.__name__}.{item.name}"] == flag_of(item)
    error = SettingsError(
        "TrainConfig.batch_size", "64 exceeds the 3 training blocks at DataSettings.seq_len 32"
    )
    assert _under_its_flag(error, {}) == "--batch-size: 64 exceeds the 3 training blocks at --seq-len 32"
