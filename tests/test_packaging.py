"""The library installs without the demo's and the report's dependencies, and says what to install where a
command needs one (issue 29)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("transformers", "tokenizers", "sklearn", "matplotlib")

WITHOUT_EXTRAS = textwrap.dedent(
    """
    import sys
    for name in {optional!r}:
        sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
    import torch, numscope
    from numscope.advisor import advise
    from numscope.cli import main
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(16, 64)
    with numscope.observe(model, candidates=["bf16", "fp8_e4m3", "mxfp4"]) as observer:
        model(x).square().sum().backward()
        observer.step()
    analysis = observer.analysis()
    analysis.save(sys.argv[1])
    plan = advise(analysis).plan
    numscope.convert(model, plan)
    model(x).sum().backward()
    codes = [main(["formats"]), main(["recommend", sys.argv[1], "-o", sys.argv[2]])]
    train = ["train", "--model", "tiny-bert", "--text", sys.argv[3], "--steps", "1", "--plan", "fp8"]
    codes.append(main([*train, "--out", sys.argv[4]]))
    print("codes", codes)
    """
)


def test_core_dependencies_leave_the_demo_and_the_report_to_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in ("transformers", "tokenizers", "scikit-learn", "matplotlib"):
        assert name not in core, name
    extras = project["optional-dependencies"]
    assert {"transformers", "tokenizers", "scikit-learn", "matplotlib"} <= {
        requirement.split(">")[0].split("=")[0] for requirement in extras["demo"]
    }
    assert "numscope[demo,docs]" in extras["dev"]  # ./run installs dev: what the tests and the docs need
    assert project["requires-python"].startswith(">=3.11")


def test_the_library_and_its_commands_run_without_the_extras(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(WITHOUT_EXTRAS.format(optional=OPTIONAL))
    text = tmp_path / "text.txt"
    text.write_text("a short text for a tokenizer\n\n" * 20)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = [str(tmp_path / "analysis"), str(tmp_path / "plan.yaml"), str(text), str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "codes [0, 0, 2]" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "plan.yaml").is_file()
    needs = [line for line in done.stderr.splitlines() if line.startswith("numscope train: error:")]
    assert needs == [
        "numscope train: error: this command needs transformers, which is not installed: "
        "pip install 'numscope[demo]' (or pip install transformers)"
    ], done.stderr[-2000:]


def test_torch_is_a_floor_so_that_a_users_torch_stays() -> None:
    """pip keeps an installed torch that satisfies the requirement: every 2.x from the oldest supported
    2.11 on (the suite runs on it, ``./run compat``), CPU or CUDA build, satisfies it (no upper bound that
    would replace a newer torch)."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch = next(r for r in map(Requirement, project["dependencies"]) if r.name == "torch")
    for version in ("2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu", "2.14.1", "2.15.0", "2.30.0"):
        assert torch.specifier.contains(version), version
    assert not torch.specifier.contains("2.10.1")  # older than the oldest release the suite runs on
