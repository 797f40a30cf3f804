"""The base of every error numscope raises about what it was given (a plan, a format, a model, a path...).

``except numscope.NumscopeError`` catches them all; each is also the builtin exception it refines
(``ValueError``, ``FileNotFoundError``, ``ImportError``), so code written against those keeps working. The
command line prints a ``NumscopeError`` as one line (exit 2); anything else is a bug and shows its traceback.
"""

from __future__ import annotations


class NumscopeError(Exception):
    """An error about numscope's input, with a message that says what was wrong and what is allowed."""


class WorkflowError(NumscopeError, ValueError):
    """A user mistake in a workflow call: a missing file, a bad model, plan, flag or run folder."""


class SettingsError(NumscopeError, ValueError):
    """A value of a settings object that is not allowed: ``setting`` names it as the Python API does
    (``SensitivitySettings.early``), ``problem`` says what was wrong and what is allowed. The command line
    prints it under the flag that sets it (one table, in :mod:`numscope.cli`)."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting}: {problem}")
        self.setting = setting
        self.problem = problem
