"""The command line: real subprocess calls of the installed entry point."""

from __future__ import annotations

import subprocess
import sys

import numscope
from numscope.cli import formats_table, main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "numscope.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_formats_table_lists_every_format_with_its_facts() -> None:
    rows = {row["format"]: row for row in formats_table()}
    assert set(rows) == {f.name for f in numscope.formats()}
    assert rows["fp8_e4m3"]["max"] == "448" and rows["fp8_e4m3"]["inf"] == "no"
    assert rows["fp8_e5m2"]["max"] == "57344" and rows["fp8_e5m2"]["inf"] == "yes"
    assert rows["mxfp8_e4m3"]["bits"] == "8.25"
    assert rows["nvfp4"]["bits"] == "4.5"


def test_formats_command_prints_the_table() -> None:
    result = run_cli("formats")
    assert result.returncode == 0, result.stderr
    assert "| fp8_e4m3 " in result.stdout and "| nvfp4 " in result.stdout


def test_unknown_command_fails_with_usage(capsys) -> None:
    try:
        main(["no-such-command"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "invalid choice" in capsys.readouterr().err
