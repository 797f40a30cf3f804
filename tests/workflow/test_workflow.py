"""The verbs behind the command line (:mod:`numscope.workflow`, one module per verb): what the package
exports, and how their errors reach the user."""

from __future__ import annotations

from pathlib import Path

import pytest

from numscope import workflow
from numscope.errors import NumscopeError, WorkflowError
from numscope.study import StudyError
from numscope.workflow import advice, export, reports, studies


def test_the_package_exports_each_verb_from_its_module() -> None:
    """``from numscope import workflow`` keeps every verb where users called it, each the function its own
    module defines (no second copy)."""
    homes = {
        "recommend_plan": advice,
        "default_budget": advice,
        "find_analysis": advice,
        "export_plan": export,
        "model_sites": export,
        "report": reports,
        "calibrate_gap_model": studies,
        "plan_study": studies,
        "study": studies,
    }
    for name, module in homes.items():
        assert getattr(workflow, name) is getattr(module, name), name
        assert getattr(module, name).__module__ == module.__name__
    assert all(hasattr(workflow, name) for name in workflow.__all__)


def test_a_study_error_reaches_the_caller_as_the_study_says_it(tmp_path: Path) -> None:
    """The study's own error (a NumscopeError, which the command line prints in one line) is not re-wrapped
    on its way out: the caller gets what the study raised, with its message."""
    with pytest.raises(StudyError, match=r"budget 40 must lie between") as raised:
        workflow.plan_study(tmp_path / "study", quick=True, budgets=[40.0])
    assert isinstance(raised.value, NumscopeError)
    assert not (tmp_path / "study" / "runs").exists()  # refused before anything ran


def test_the_command_line_prints_a_study_error_in_one_line(tmp_path: Path, capsys) -> None:
    from numscope.cli import main

    code = main(["study", "plans", "--quick", "--budgets", "40", "--out", str(tmp_path / "study")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "budget 40 must lie between" in err[0]


def test_an_unknown_export_target_is_refused_with_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(WorkflowError, match=r"`target` tpu: unknown target; allowed: .*te"):
        workflow.export_plan("fp8", "tpu", "tiny-bert", tmp_path / "out")


def test_find_analysis_takes_an_analysis_folder_or_the_run_folder_around_it(tmp_path: Path) -> None:
    run = tmp_path / "fp32"
    (run / "analysis").mkdir(parents=True)
    assert workflow.find_analysis(run) == run / "analysis"
    (run / "analysis" / "analysis.json").write_text("{}")
    assert workflow.find_analysis(run / "analysis") == run / "analysis"
