"""The README's promises: its two set-up commands are the ones ``run`` and CI use, its demo table is the
demo's; and the Python example of docs/python.md runs as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PYTHON_PAGE = (ROOT / "docs" / "python.md").read_text(encoding="utf-8")


def test_the_python_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"## Example\n.*?```python\n(.*?)```", PYTHON_PAGE, flags=re.DOTALL)
    assert blocks, "docs/python.md has no example"
    for block in blocks:
        script = tmp_path / "example.py"
        script.write_text(block, encoding="utf-8")
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "4.625" in result.stdout  # the bits the comment promises for nvfp4 on a 4 × 64 tensor
        printed = re.search(r"It prints:\n\n```\n(.*?)```", PYTHON_PAGE, flags=re.DOTALL)
        assert printed is not None and printed.group(1).splitlines()[0] == result.stdout.splitlines()[0]
    assert (tmp_path / "plan.yaml").is_file()


def test_the_two_set_up_commands_are_what_run_and_ci_do() -> None:
    setup = re.search(r"## Set-up: two commands\n(.*?)\n## ", README, flags=re.DOTALL)
    assert setup is not None, "README.md lost its set-up section"
    commands = re.findall(r"^(\./run \w+)", setup.group(1), flags=re.MULTILINE)
    assert commands[:2] == ["./run demo", "./run test"]
    run = (ROOT / "run").read_text()
    assert "demo) setup; exec .venv/bin/numscope demo" in run
    assert "test) setup; exec .venv/bin/python -m pytest" in run
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "./run test" in ci  # then the same tests on the oldest supported torch (./run compat)


def test_the_formats_table_is_what_numscope_formats_prints() -> None:
    """The formats page (docs/formats.md, linked from the README) shows the table the command prints."""
    from numscope.cli import formats_table, render_table

    assert render_table(formats_table()) in (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")


def test_the_demo_table_is_the_demos_runs_at_its_defaults() -> None:
    """The README's demo section names the demo's default length and shows one row per run the demo trains,
    in the order the demo prints them (a change of the demo's runs or length must come with a new table)."""
    from numscope.demo.claims import HEURISTIC, RECOMMENDED, REFERENCE
    from numscope.demo.main import BASELINES, DemoConfig, heuristic_spec, noise_spec, recommended_seed_spec

    config = DemoConfig()
    section = re.search(r"## The demo\n(.*?)\n## ", README, flags=re.DOTALL)
    assert section is not None, "README.md lost its demo section"
    assert f"{config.train.steps:,} AdamW steps per run" in section.group(1)
    rows = re.findall(r"^\| (\S+) +\| \d", section.group(1), flags=re.MULTILINE)
    seeds = config.noise_seeds
    expected = [REFERENCE.name, RECOMMENDED, HEURISTIC, *(spec.name for spec in BASELINES)]
    expected += [noise_spec(seed).name for seed in seeds]
    expected += [recommended_seed_spec(seed).name for seed in seeds]
    expected += [heuristic_spec(seed).name for seed in seeds]
    assert rows == expected
