"""numscope.run.folders: a folder's recorded settings against a rerun's."""

from __future__ import annotations

from numscope.run.config import TrainConfig
from numscope.run.folders import ADDED_SETTINGS, setting_changes


def test_a_difference_names_the_nested_setting() -> None:
    assert setting_changes({"train": {"steps": 4}}, {"train": {"steps": 5}}) == ["train.steps: 4 → 5"]
    assert setting_changes({"train": {"steps": 4}}, {"train": {"steps": 4}}) == []


def test_a_folder_recorded_before_a_setting_existed_resumes_at_its_earlier_value() -> None:
    before = {"train": {"steps": 4}}  # written before TrainConfig had mask_probability
    assert setting_changes(before, {"train": {"steps": 4, "mask_probability": 0.15}}) == []
    assert setting_changes(before, {"train": {"steps": 4, "mask_probability": 0.3}}) == [
        "train.mask_probability: 0.15 → 0.3"
    ]
    # the earlier value is the setting's default, which every run had before it could be set
    assert ADDED_SETTINGS["mask_probability"] == TrainConfig().mask_probability
