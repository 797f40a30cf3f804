"""``numscope`` on the command line: a thin face over the Python API (one module per group of commands)."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path

from numscope.cli.advice import _register_calibrate, _register_recommend
from numscope.cli.common import CLIError, render_table
from numscope.cli.demo import _register_demo
from numscope.cli.diagnose import _register_band, _register_localize
from numscope.cli.forecast import _register_forecast
from numscope.cli.info import _cmd_formats, _cmd_recipes, formats_table
from numscope.cli.runs import (
    _register_analyze,
    _register_compare,
    _register_evaluate,
    _register_export,
    _register_report,
    _register_train,
)
from numscope.cli.study import _register_study


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="numscope",
        description="Measured, not guessed: exact low-precision formats and per-GEMM precision plans.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("formats", help="print every number format with its range facts")
    p.set_defaults(func=_cmd_formats)
    p = sub.add_parser(
        "recipes",
        help="list the field's published training recipes (TE, torchao, DeepSeek-V3, MXFP4) usable as --plan",
    )
    p.add_argument("name", nargs="?", help="one recipe: show its plan, operand by operand, and its notes")
    p.set_defaults(func=_cmd_recipes)
    for register in _EXTRA_COMMANDS:
        register(sub)
    everywhere = _all_flag_names(sub.choices.values())
    for verb in sub.choices.values():  # the help names what the library calls `name` by its flag
        names = {**everywhere, **flag_names(verb)}
        verb.description = in_flags(verb.description, names) if verb.description else verb.description
        for action in verb._actions:
            if action.help and action.help != argparse.SUPPRESS:
                action.help = in_flags(action.help, names)
    return parser


_NAMED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")
"""How the library names a Python parameter or setting in a message: `bit_budget`, `TrainConfig.steps`."""

#: where a verb's flag does not carry the Python parameter's name (the dest)
_PARAMETERS = {"export": {"target": "--to"}}


def flag_names(verb: argparse.ArgumentParser) -> dict[str, str]:
    """What the library calls a parameter or a setting (`name`, `Class.field`) → the flag of ``verb`` that
    sets it (old, renamed flags left out)."""
    from numscope.cli.common import _Renamed
    from numscope.cli.runs import SETTING_FLAGS

    names = dict(SETTING_FLAGS)
    for action in verb._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and not isinstance(action, _Renamed) and action.dest not in names:
            names[action.dest] = longs[0]
    names.update(_PARAMETERS.get(verb.prog.split()[-1], {}))
    return names


def _all_flag_names(verbs: Iterable[argparse.ArgumentParser]) -> dict[str, str]:
    """`name` → flag over every verb, for a message that names another verb's flag (``numscope calibrate
    `also` ...``); a name two verbs give different flags is left out."""
    seen: dict[str, set[str]] = {}
    for verb in verbs:
        for name, flag in flag_names(verb).items():
            seen.setdefault(name, set()).add(flag)
    return {name: next(iter(flags)) for name, flags in seen.items() if len(flags) == 1}


def in_flags(text: str, names: dict[str, str]) -> str:
    """``text`` with each parameter the library names in backquotes (`name`) given as its flag; a name
    the verb has no flag for stays as it is."""
    return _NAMED.sub(lambda m: names.get(m.group(1), m.group(0)), text)


class _InFlags:
    """A text stream that writes what the library prints with its parameters named as flags."""

    def __init__(self, stream: object, names: dict[str, str]) -> None:
        self._stream, self._names = stream, names

    def write(self, text: str) -> int:
        return self._stream.write(in_flags(text, self._names))  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _speaking_flags(names: dict[str, str]) -> Iterator[None]:
    """stdout and stderr name the library's parameters by their flags while a command runs."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _InFlags(sys.stdout, names), _InFlags(sys.stderr, names)  # type: ignore
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_demo,
    _register_analyze,
    _register_forecast,
    _register_recommend,
    _register_train,
    _register_compare,
    _register_evaluate,
    _register_report,
    _register_study,
    _register_calibrate,
    _register_export,
    _register_localize,
    _register_band,
]


def _is_user_error(error: BaseException) -> bool:
    """Errors that describe the user's input (printed in one line); any other exception is a bug."""
    from numscope.errors import NumscopeError

    return isinstance(error, NumscopeError)


def _under_its_flag(error: BaseException, names: dict[str, str]) -> str:
    """The error's message with every parameter the library names (`name`) given as its flag; in a
    :class:`numscope.errors.SettingsError`, every setting named as the Python API names it
    (``SensitivitySettings.early``) is named by the flag that sets it (``--sensitivity-early``)."""
    from numscope.cli.runs import SETTING_FLAGS
    from numscope.errors import SettingsError

    message = in_flags(str(error), names)
    if isinstance(error, SettingsError):
        for setting in sorted(SETTING_FLAGS, key=len, reverse=True):
            message = message.replace(setting, SETTING_FLAGS[setting])
    return message


def _missing_extra(error: BaseException) -> str | None:
    """What to install, where ``error`` is an optional dependency's absence (numscope[demo], [report])."""
    from numscope._lazy import MissingDependency, missing_hint

    if isinstance(error, MissingDependency):
        return str(error)
    hint = missing_hint(error.name) if isinstance(error, ImportError) and error.name else None
    return None if hint is None else f"this command {hint}"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _attach_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--lr -1e-3`` as ``--lr=-1e-3``: argparse takes a token that starts with '-' for a flag unless it
    looks like a plain negative integer or decimal, so ``-1e-3`` would be refused as an unknown flag
    instead of reaching the option's own check. Only after options that take a value."""
    takes_value: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                takes_value |= {o for a in sub._actions if a.nargs != 0 for o in a.option_strings}
        elif action.nargs != 0:
            takes_value |= set(action.option_strings)
    out: list[str] = []
    for token in argv:
        if out and out[-1] in takes_value and token.startswith("-") and _is_number(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _show_note(command: str, names, message, category, filename, lineno, file=None, line=None) -> None:
    """numscope's own warnings as one line, ``numscope COMMAND: note: ...``; others as Python shows them."""
    if str(filename).startswith(_PACKAGE_DIR) and issubclass(category, UserWarning):
        print(f"numscope {command}: note: {in_flags(str(message), names)}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    console = argv is None  # run as the numscope command (not called from Python, where warnings stay)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_attach_negative_values(parser, argv))
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    names = {**_all_flag_names(verbs.values()), **flag_names(verbs[args.command])}
    try:
        with warnings.catch_warnings(), _speaking_flags(names):
            if console:
                warnings.showwarning = partial(_show_note, args.command, names)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"numscope {args.command}: interrupted; finished work is kept on disk", file=sys.stderr)
        return 130
    except Exception as error:
        missing = _missing_extra(error)
        if missing is not None:
            print(f"numscope {args.command}: error: {missing}", file=sys.stderr)
            return 2
        if not _is_user_error(error):
            raise
        message = " ".join(_under_its_flag(error, names).split("\n"))
        print(f"numscope {args.command}: error: {message}", file=sys.stderr)
        return 2


__all__ = ["CLIError", "build_parser", "formats_table", "main", "render_table"]
