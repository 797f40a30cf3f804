"""Checkpoints: atomic writes, clear errors on bad files, and bit-exact resume of the whole recipe."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from numscope.train import (
    CheckpointError,
    LossScaler,
    MasterWeights,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from numscope.train import checkpoint as checkpoint_module


def _state() -> dict[str, object]:
    return {
        "weights": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.float16)},
        "step": 7,
        "history": [1.5, 2.5],
        "pair": (1, None),
        "dtype": torch.bfloat16,
        "name": "run-1",
    }


def _assert_same_state(loaded: dict[str, object], expected: dict[str, object]) -> None:
    assert loaded.keys() == expected.keys()
    for name in ("w", "b"):
        assert torch.equal(loaded["weights"][name], expected["weights"][name])
        assert loaded["weights"][name].dtype == expected["weights"][name].dtype
    assert {k: v for k, v in loaded.items() if k != "weights"} == {
        k: v for k, v in expected.items() if k != "weights"
    }


def test_round_trip(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _state())
    _assert_same_state(load_checkpoint(path), _state())
    assert [entry.name for entry in tmp_path.iterdir()] == ["checkpoint.pt"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open() would create it


def test_vocabulary_enums_in_a_state_are_written_as_plain_strings(tmp_path):
    # observer and scaler states key their entries by (site, Gemm, Operand): the file must stay plain data
    from collections import OrderedDict

    from numscope.vocab import Gemm, Operand

    weights = torch.nn.Linear(2, 2).state_dict()
    state = {
        "observer": {("fc", Gemm.WGRAD, Operand.INPUT): [Gemm.FPROP, (1, Operand.WEIGHT)]},
        "model": weights,
    }
    save_checkpoint(tmp_path / "c.pt", state)
    loaded = load_checkpoint(tmp_path / "c.pt")
    ((key, value),) = loaded["observer"].items()
    assert key == ("fc", "wgrad", "input") and value == ["fprop", (1, "weight")]
    assert all(type(part) is str for part in (*key, value[0], value[1][1]))
    assert isinstance(loaded["model"], OrderedDict) and loaded["model"]._metadata == weights._metadata


@pytest.mark.parametrize("failing", ["torch.save", "os.replace"])
def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failing):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _state())

    real_save = torch.save

    def save_half_then_die(obj, file):
        real_save({"partial": torch.ones(1000)}, file)
        file.truncate(file.tell() // 2)
        raise OSError("simulated crash while writing")

    def die_on_rename(source, target):
        raise OSError("simulated crash before rename")

    if failing == "torch.save":
        monkeypatch.setattr(checkpoint_module.torch, "save", save_half_then_die)
    else:
        monkeypatch.setattr(checkpoint_module.os, "replace", die_on_rename)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint(path, {"step": 8})
    monkeypatch.undo()
    _assert_same_state(load_checkpoint(path), _state())
    assert [entry.name for entry in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _state())
    size = path.stat().st_size
    with open(path, "r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(CheckpointError, match="corrupt or truncated") as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert str(path) in message and f"{size // 2} bytes" in message and "earlier checkpoint" in message


def test_garbage_file_is_a_clear_error(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"\(0 bytes\) is corrupt or truncated"):
        load_checkpoint(path)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere.pt"
    with pytest.raises(FileNotFoundError, match=r"nowhere\.pt"):
        load_checkpoint(path)


def test_newer_format_version_is_refused(tmp_path):
    path = tmp_path / "future.pt"
    torch.save({"numscope_checkpoint": 2, "state": {}}, path)
    with pytest.raises(
        CheckpointError, match=r"format version 2; this numscope reads versions 1 to 1; upgrade"
    ):
        load_checkpoint(path)


def test_foreign_torch_file_is_refused(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"model": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match="not a numscope checkpoint"):
        load_checkpoint(path)


class _Opaque:
    """An object that only full unpickling could rebuild."""


def test_arbitrary_objects_are_not_unpickled(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"opaque": _Opaque()})
    with pytest.raises(CheckpointError, match=r"objects other than tensors and plain containers.*_Opaque"):
        load_checkpoint(path)


def test_rng_state_round_trip_through_a_file(tmp_path):
    generator = torch.Generator().manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gauss in numpy's state
    path = tmp_path / "rng.pt"
    save_checkpoint(path, {"rng": rng_state({"rounding": generator})})

    def draw() -> tuple[object, ...]:
        return (
            random.random(),
            np.random.standard_normal(3).tolist(),
            torch.rand(3).tolist(),
            torch.rand(3, generator=generator).tolist(),
        )

    first = draw()
    set_rng_state(load_checkpoint(path)["rng"], {"rounding": generator})
    assert draw() == first
    with pytest.raises(KeyError, match=r"holds generators \['rounding'\].*given \[\]"):
        set_rng_state(load_checkpoint(path)["rng"])


# ---------------------------------------------------------------------- bit-exact resume
TOTAL_STEPS, CHECKPOINT_STEP = 6, 3


class _Recipe:
    """Everything a mixed-precision run carries: fp16 model, fp32 masters, AdamW, dynamic loss scale,
    dropout (torch RNG), data order (python and numpy RNG) and a private noise generator."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.LayerNorm(16), nn.Linear(16, 2))
        self.master = MasterWeights(self.model, dtype=torch.float16)
        self.optimizer = torch.optim.AdamW(self.master.master_params(), lr=1e-2)
        self.scaler = LossScaler(init_scale=2.0**8, growth_interval=2)
        self.noise = torch.Generator().manual_seed(99)
        data_generator = torch.Generator().manual_seed(5)
        self.inputs = torch.randn(32, 4, generator=data_generator)
        self.targets = torch.randn(32, 2, generator=data_generator)

    def train_step(self, step: int) -> None:
        rows = random.sample(range(32), 8)
        rows[np.random.randint(8)] = int(np.random.randint(32))
        inputs = self.inputs[rows] + 0.01 * torch.randn(8, 4, generator=self.noise)
        loss = nn.functional.mse_loss(self.model(inputs), self.targets[rows])
        self.scaler.scale(loss).backward()
        if step == 1:  # one overflow, so the scaler's backoff and growth tracker are part of the state
            self.model[0].bias.grad[0] = float("inf")
        self.master.step(self.optimizer, self.scaler)

    def state(self, step: int) -> dict[str, object]:
        return {
            "step": step,
            "master": self.master.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng_state({"noise": self.noise}),
        }

    def load(self, state: dict[str, object]) -> int:
        self.master.load_state_dict(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"], {"noise": self.noise})
        return state["step"]


def test_resume_from_checkpoint_is_bit_exact(tmp_path):
    path = tmp_path / "run.pt"
    random.seed(10)
    np.random.seed(11)
    uninterrupted = _Recipe()
    for step in range(TOTAL_STEPS):
        uninterrupted.train_step(step)
        if step + 1 == CHECKPOINT_STEP:
            save_checkpoint(path, uninterrupted.state(step + 1))

    random.seed(12345)  # the resumed process starts from unrelated random state
    np.random.seed(54321)
    torch.manual_seed(777)
    resumed = _Recipe()
    for step in range(resumed.load(load_checkpoint(path)), TOTAL_STEPS):
        resumed.train_step(step)

    assert resumed.scaler.state_dict() == uninterrupted.scaler.state_dict()
    assert uninterrupted.scaler.skipped_steps == 1
    for (name, mine), theirs in zip(
        resumed.master.named_master_params(), uninterrupted.master.master_params(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    for mine, theirs in zip(resumed.model.parameters(), uninterrupted.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
