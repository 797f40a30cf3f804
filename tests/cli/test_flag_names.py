"""One meaning per flag name: across the verbs every flag name has one kind, one type and one set of choices;
old names parse as the new ones did and say so in one line; help texts state what a flag does, not what a
study found; the library outside ``numscope.cli`` names no flag in a message."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
from collections import defaultdict
from pathlib import Path

import pytest

from numscope.cli import build_parser
from numscope.cli.common import _Renamed

SRC = Path(__file__).resolve().parents[2] / "src" / "numscope"


def verbs() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def long_flags(renamed: bool) -> dict[str, list[tuple[str, argparse.Action]]]:
    """Each long flag name -> (verb, action), the old names (``_Renamed``) or the current ones."""
    found: dict[str, list[tuple[str, argparse.Action]]] = defaultdict(list)
    for verb, parser in verbs().items():
        for action in parser._actions:
            if isinstance(action, _Renamed) != renamed:
                continue
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    found[option].append((verb, action))
    return found


def meaning(action: argparse.Action) -> tuple[object, ...]:
    kind = type(action).__name__
    parse = getattr(action.type, "__name__", action.type)
    choices = tuple(action.choices) if action.choices is not None else None
    return kind, parse, choices, action.nargs


def test_every_flag_name_has_one_type_and_one_set_of_choices() -> None:
    current = long_flags(renamed=False)
    assert len(current) > 80  # the scan sees every verb's flags
    several = {
        flag: sorted({(verb, *map(str, meaning(a))) for verb, a in uses})
        for flag, uses in current.items()
        if len({meaning(a) for _, a in uses}) > 1
    }
    assert not several, several


def test_each_old_name_is_hidden_and_names_a_current_flag() -> None:
    current = long_flags(renamed=False)
    old = long_flags(renamed=True)
    assert {"--objective", "--seeds", "--target", "--candidates", "--every", "--task"} <= set(old)
    for flag, uses in old.items():
        for verb, action in uses:
            assert action.help == argparse.SUPPRESS, (verb, flag)
            new = action.renamed_to.split()[0]
            assert any(v == verb for v, _ in current[new]), (verb, flag, new)


def parse(*argv: str) -> tuple[argparse.Namespace, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        args = build_parser().parse_args(list(argv))
    return args, err.getvalue()


RUN = ("--model", "tiny-bert", "--text", "t.txt", "--out", "o")


@pytest.mark.parametrize(
    "old, new, field",
    [
        (
            ("train", *RUN, "--plan", "fp8", "--objective", "clm"),
            ("train", *RUN, "--plan", "fp8", "--task", "clm"),
            "objective",
        ),
        (("export", "fp8", "--to", "te", "--model", "m", "--objective", "mlm"), None, "objective"),
        (("recommend", "r", "--objective", "noise"), ("recommend", "r", "--minimize", "noise"), "objective"),
        (
            ("forecast", *RUN, "--target", "te,torchao"),
            ("forecast", *RUN, "--stacks", "te,torchao"),
            "stacks",
        ),
        (("calibrate", *RUN, "--seeds", "3", "4"), ("calibrate", *RUN, "--seed-list", "3", "4"), "seeds"),
        (("study", "plans", "--seeds", "5"), ("study", "plans", "--seed-list", "5"), "seeds"),
        (
            ("localize", *RUN, "--plan", "fp8", "--candidates", "2", "--every", "5"),
            ("localize", *RUN, "--plan", "fp8", "--top-sites", "2", "--drift-every", "5"),
            "candidates",
        ),
        (("demo", "--task", "cnn"), ("demo", "--workload", "cnn"), "workload"),
        (("demo", "--task", "mlm"), ("demo", "--workload", "bert"), "workload"),
        (
            ("recommend", "r", "--max-be-ratio", "none"),
            ("recommend", "r", "--criterion", "max_be_ratio=none"),
            "max_be_ratio",
        ),
    ],
)
def test_an_old_name_parses_as_the_new_one_with_one_note(
    old: tuple[str, ...], new: tuple[str, ...] | None, field: str
) -> None:
    args, note = parse(*old)
    lines = note.strip().splitlines()
    assert len(lines) >= 1 and all("the old name goes in the next release" in line for line in lines), note
    if new is None:
        assert getattr(args, field) == "mlm"
        return
    fresh, quiet = parse(*new)
    assert quiet == ""
    if field == "max_be_ratio":  # the old flag set the limit itself; --criterion gives it by name
        assert args.max_be_ratio is None and fresh.criterion == ["max_be_ratio=none"]
        return
    assert getattr(args, field) == getattr(fresh, field)
    if field == "candidates":
        assert args.every == fresh.every == 5


# what a study found, said in a help text (the docs' result pages hold it)
STUDY_WORDS = re.compile(r"plan study|tied|beat|as before|docs/|on a GQA|within \d+x", re.IGNORECASE)


def test_no_help_text_holds_a_study_result() -> None:
    found = []
    for verb, parser in verbs().items():
        texts = [parser.description or ""] + [a.help or "" for a in parser._actions]
        found += [(verb, text) for text in texts if STUDY_WORDS.search(text)]
    assert not found, found


def _messages(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module (f-strings' parts included) but its documentation (docstrings, a
    name's docstring below it), the flag a setting declares (``setting(..., flag="--name")``, which the CLI
    reads) and a whole command line shown as such (a report's ``numscope demo ...``)."""
    tree = ast.parse(path.read_text())
    documentation = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    declared = {
        id(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg == "flag"
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in documentation | declared
        and not node.value.startswith("numscope ")
    ]


def test_no_message_outside_the_cli_names_a_flag() -> None:
    names = set(long_flags(renamed=False)) | set(long_flags(renamed=True))
    flag = re.compile(r"--[a-z][a-z0-9-]*")
    files = [p for p in sorted(SRC.rglob("*.py")) if "cli" not in p.relative_to(SRC).parts]
    assert len(files) > 100
    found = [
        f"{path.relative_to(SRC)}:{line}: {hits}"
        for path in files
        for line, text in _messages(path)
        if (hits := [h for h in flag.findall(text) if h in names])
    ]
    assert not found, "\n".join(found)


def test_the_scan_sees_a_flag_in_a_message(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text(
        '"""Docs may say --model."""\n\ndef f(x):\n    raise ValueError(f"--model {x}: gone")\n'
    )
    assert [text for _, text in _messages(sample)] == ["--model ", ": gone"]
