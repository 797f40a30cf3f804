"""Loss logs of a user's own runs: CSV and TensorBoard event files (written by the real
torch.utils.tensorboard writer), read without TensorBoard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numscope.diagnose import LogError, read_loss_log


def test_a_csv_log_is_read_by_its_step_and_loss_columns(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    path.write_text("step,lr,loss,val_loss\n1,1e-3,5.5,\n2,1e-3,5.25,5.3\n3,1e-3,,\n2,1e-3,5.0,\n")
    assert read_loss_log(path) == {1: 5.5, 2: 5.0}  # a step logged again keeps its last value
    assert read_loss_log(path, key="val_loss") == {2: 5.3}
    other = tmp_path / "other.csv"
    other.write_text("iteration,train_loss\n10,3.0\n20,2.5\n")
    assert read_loss_log(other) == {10: 3.0, 20: 2.5}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("when,loss\n1,2.0\n", "needs a step column"),
        ("step,accuracy\n1,0.5\n", "a loss column"),
        ("step,loss\n1,\n", "no rows with both"),
        ("step,loss\n1,abc\n", "not a CSV loss log"),
    ],
)
def test_a_csv_that_is_not_a_loss_log_says_what_it_lacks(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "log.csv"
    path.write_text(text)
    with pytest.raises(LogError, match=says):
        read_loss_log(path)
    with pytest.raises(LogError, match="no such loss log"):
        read_loss_log(tmp_path / "missing.csv")


def test_tensorboard_event_files_are_read_as_the_writer_wrote_them(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    losses = {step: 6.0 / (1 + step) + 0.001 * step for step in range(0, 40, 3)}
    with SummaryWriter(log_dir=str(tmp_path / "tb")) as writer:
        for step, loss in losses.items():
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("lr", 1e-3, step)
    expected = {step: float(torch.tensor(loss, dtype=torch.float32)) for step, loss in losses.items()}
    assert read_loss_log(tmp_path / "tb") == expected  # a folder: the first loss tag found
    (event,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    assert read_loss_log(event, key="lr") == {step: pytest.approx(1e-3) for step in losses}
    with pytest.raises(LogError, match="no scalar tagged 'accuracy'; tags: lr, train/loss"):
        read_loss_log(event, key="accuracy")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogError, match="without TensorBoard event files"):
        read_loss_log(tmp_path / "empty")
    broken = tmp_path / "events.out.tfevents.broken"
    broken.write_bytes(b"\x05" * 40)
    with pytest.raises(LogError, match=r"not a TensorBoard event file|no loss scalar"):
        read_loss_log(broken)
