"""Every file numscope writes for the user goes through numscope._atomic: created with the permissions the
user's umask gives a plain open() (not mkstemp's 0600), the previous file kept when writing fails midway, no
temporary left behind, and a resumed run's log cut back without ever being torn."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from numscope import _atomic
from numscope._atomic import atomic_write, atomic_write_bytes, atomic_write_text
from numscope.analysis import Analysis, OperandRecord, Sensitivity
from numscope.plan import Plan
from numscope.report import write_report
from numscope.run import loop
from numscope.train import save_checkpoint


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_text_and_bytes_round_trip_and_leave_only_the_target(tmp_path):
    text_path = atomic_write_text(tmp_path / "a.txt", "ä\nb\r\n")
    assert text_path == tmp_path / "a.txt"
    assert text_path.read_bytes() == "ä\nb\r\n".encode()  # utf-8, no newline translation
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_mode_follows_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "f.txt", "x")
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "f.txt") == 0o666 & ~umask


def test_a_writer_that_raises_midway_keeps_the_previous_file(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    def write_half_then_die(file):
        file.write(b"new and half")
        raise RuntimeError("simulated crash while writing")

    with pytest.raises(RuntimeError, match="simulated crash"):
        atomic_write(path, write_half_then_die)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_a_failed_rename_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    def die_on_rename(source, target):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(_atomic.os, "replace", die_on_rename)
    with pytest.raises(OSError, match="simulated crash"):
        atomic_write_text(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def _analysis() -> Analysis:
    analysis = Analysis(candidates=("bf16",))
    key = ("layer.query", "wgrad", "grad_output")
    analysis.operands[key] = {0: OperandRecord({"amax": 2.0}, {"bf16": {"sqnr_db": 50.0}}, 100, 4096)}
    analysis.elements[key] = 4096
    return analysis


@pytest.mark.usefixtures("umask_022")
def test_user_outputs_are_0644_under_umask_022(tmp_path):
    Plan.uniform("bf16").save(tmp_path / "plan.yaml")
    _analysis().save(tmp_path / "analysis")
    Sensitivity().save(tmp_path / "sensitivity")
    write_report(tmp_path / "report.html", title="t", runs=[])
    save_checkpoint(tmp_path / "checkpoint.pt", {"step": 1})
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        "plan.yaml",
        "analysis/analysis.json",
        "analysis/analysis.csv",
        "sensitivity/sensitivity.json",
        "report.html",
        "checkpoint.pt",
    }
    assert {p.name: _mode(p) for p in written} == {p.name: 0o644 for p in written}


def _log(path: Path, steps: range) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=loop.LOG_FIELDS)
        writer.writeheader()
        for step in steps:
            writer.writerow({"step": step, "lr": 0.1, "loss": 2.0 + step, "scale": 1024.0, "skipped": 0})


def test_truncate_log_keeps_the_header_and_the_rows_up_to_the_step(tmp_path):
    path = tmp_path / "log.csv"
    _log(path, range(10))
    _log(tmp_path / "expected.csv", range(5))
    loop._truncate_log(path, 4)
    assert path.read_bytes() == (tmp_path / "expected.csv").read_bytes()
    assert [row["step"] for row in loop.read_log(path)] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["expected.csv", "log.csv"]


def test_truncate_log_interrupted_while_rewriting_keeps_the_whole_log(tmp_path, monkeypatch):
    path = tmp_path / "log.csv"
    _log(path, range(10))
    before = path.read_bytes()

    def die_on_rename(source, target):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(_atomic.os, "replace", die_on_rename)
    with pytest.raises(OSError, match="simulated crash"):
        loop._truncate_log(path, 4)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["log.csv"]


def test_truncate_log_drops_a_row_a_crash_cut_off(tmp_path):
    """A torn last row ('1' of '105', no line end) is not taken for step 1, nor kept half-written."""
    path = tmp_path / "log.csv"
    _log(path, range(5))
    _log(tmp_path / "expected.csv", range(5))
    with path.open("a", encoding="utf-8", newline="") as handle:
        handle.write("1")  # the crash hit while writing step 105's row
    loop._truncate_log(path, 100)
    assert path.read_bytes() == (tmp_path / "expected.csv").read_bytes()
    assert [row["step"] for row in loop.read_log(path)] == [0, 1, 2, 3, 4]
