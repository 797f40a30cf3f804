"""What every command shares: the one-line error, the table printer, flag types, the run flags (generated
from the config dataclasses) and the printing of a run's result."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from numscope.errors import NumscopeError


class CLIError(NumscopeError):
    """A user-facing error: printed without a traceback, exit status 2."""


class _Renamed(argparse.Action):
    """A flag's old name, kept one release: hidden from the help, it sets what the new name sets (through
    ``convert`` where the values were renamed too) and prints a one-line note naming the new flag."""

    def __init__(
        self, *args: Any, renamed_to: str, convert: Callable[[Any], Any] | None = None, **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self.renamed_to, self.convert = renamed_to, convert

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None) -> None:
        print(
            f"numscope: note: {option} is now {self.renamed_to}; the old name goes in the next release",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, self.convert(values) if self.convert else values)


def add_renamed(
    group: Any, old: str, new: str, dest: str, convert: Callable[[Any], Any] | None = None, **kwargs: Any
) -> None:
    """Keep ``old`` working one release as a hidden alias of the flag ``new`` (which sets ``dest``);
    ``kwargs`` parse its values as the old flag did (type, choices, nargs)."""
    group.add_argument(
        old, dest=dest, action=_Renamed, renamed_to=new, convert=convert, help=argparse.SUPPRESS, **kwargs
    )


def _number(value: float) -> str:
    """Six significant digits, except a power of two that is far from 1 or that six digits would round
    (2^-9 is 0.001953125): those print as 2^k, exactly."""
    if value == 0 or math.isinf(value):
        return str(value)
    exponent = math.log2(value)
    short = f"{value:.6g}"
    if exponent == int(exponent) and (abs(exponent) > 12 or float(short) != value):
        return f"2^{int(exponent)}"
    return short


def render_table(rows: Sequence[dict[str, str]]) -> str:
    """A plain fixed-width text table (Markdown-compatible pipes)."""
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["| " + " | ".join(c.ljust(widths[c]) for c in columns) + " |"]
    lines.append("|" + "|".join("-" * (widths[c] + 2) for c in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(str(row[c]).ljust(widths[c]) for c in columns) + " |")
    return "\n".join(lines)


_MODEL_HELP = (
    "the model: a checkpoint folder (config.json with model.safetensors or pytorch_model.bin, as "
    "save_pretrained writes it: training starts from its weights, with its own tokenizer.json), a "
    "built-in config (tiny-bert: masked LM; tiny-gpt2: causal LM; demo-bert: the demo's BERT shape), a "
    "folder holding only a "
    "transformers config.json or such a .json file (random weights), or a Python 'module:factory' / "
    "'file.py:factory' whose callable (given vocab_size= if it takes it) returns an nn.Module or a "
    "transformers config. Hub names (e.g. bert-base-uncased) need network access: only their config is "
    "fetched, never weights"
)


TASKS = ("auto", "mlm", "clm")


def add_task_flag(group: Any) -> None:
    """``--task auto|mlm|clm`` (the Python API's ``objective``), and its old name ``--objective``."""
    group.add_argument(
        "--task",
        dest="objective",
        choices=TASKS,
        default="auto",
        help="mlm: masked LM (15%% of tokens masked, BERT); clm: causal LM (next token, GPT); auto: mlm "
        "where transformers has a masked-LM head for the config, else clm (default: %(default)s)",
    )
    add_renamed(group, "--objective", "--task", "objective", choices=TASKS)


def add_seed_list(group: Any, default: list[int] | None, help: str) -> None:
    """``--seed-list S [S ...]``: the seeds trained, and its old name ``--seeds``."""
    group.add_argument(
        "--seed-list", dest="seeds", nargs="+", type=int, default=default, metavar="SEED", help=help
    )
    add_renamed(group, "--seeds", "--seed-list", "seeds", nargs="+", type=int)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _limit(text: str) -> float | None:
    """A criterion value: a number, or 'none'/'off' to switch the limit off."""
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}")
    return value


def _dof(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 or 'inf', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"degrees of freedom must be > 0 ('inf' for Gaussian), got {text!r}")
    return value


def _add_setting_flags(group: Any, settings: type, *, prefix: str = "", absent: bool = False) -> None:
    """One flag per field of the ``settings`` dataclass that :func:`numscope._settings.setting` describes
    (its flag name, type, default, bounds and help); :func:`_settings_from_flags` reads them back.
    ``prefix``: the parsed values' names (``args.<prefix><field>``), where two settings of one verb share a
    field name; ``absent``: an absent flag parses to None (to tell given flags apart), the help states the
    dataclass's default."""
    from numscope._settings import OFF, flag_of, kind_of, shown_default

    for item in dataclasses.fields(settings):
        meta = item.metadata
        if "help" not in meta:
            continue
        shown = shown_default(item) if absent else "%(default)s"
        options: dict[str, Any] = {
            "dest": prefix + item.name,
            "default": None if absent else item.default,
            "help": meta["help"].replace("%", "%%") + f" (default: {shown})",
        }
        kind = kind_of(item)
        if kind is str:
            options["choices"] = meta["choices"]
            if meta.get("metavar"):
                options["metavar"] = meta["metavar"]
            group.add_argument(flag_of(item), **options)
            continue
        minimum, positive = meta["minimum"], meta["positive"]
        if kind is int:
            parse = _int_at_least(int(minimum)) if minimum is not None else int
        else:
            parse = _positive_float if positive else float
        if meta.get("off"):
            parse = _or_off(parse, OFF)
        group.add_argument(
            flag_of(item), type=parse, metavar=meta.get("metavar") or ("N" if kind is int else "X"), **options
        )


def _or_off(parse: Any, off: str) -> Any:
    """``parse``, or ``off`` for the words 'none' and 'off' (a limit switched off)."""

    def parsed(text: str) -> Any:
        return off if text.strip().lower() in ("none", "off") else parse(text)

    parsed.__name__ = getattr(parse, "__name__", "value")
    return parsed


def _given_settings(settings: type, args: argparse.Namespace, prefix: str = "") -> list[str]:
    """The flags of ``settings`` given on the command line (those added with ``absent=True``)."""
    from numscope._settings import flag_of

    return [
        flag_of(f)
        for f in dataclasses.fields(settings)
        if "help" in f.metadata and getattr(args, prefix + f.name) is not None
    ]


def _settings_from_flags(settings: type, args: argparse.Namespace, *, prefix: str = "", **given: Any) -> Any:
    """The ``settings`` dataclass from the flags :func:`_add_setting_flags` added, plus ``given`` fields;
    flags added with ``absent=True`` that were not given keep the dataclass's defaults."""
    from numscope._settings import OFF

    flagged = {}
    for item in dataclasses.fields(settings):
        if "help" not in item.metadata:
            continue
        value = getattr(args, prefix + item.name)
        if value is None:  # absent: the default
            continue
        flagged[item.name] = None if value == OFF and item.metadata.get("off") else value
    return settings(**flagged, **given)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    from numscope.run.config import TrainConfig
    from numscope.run.sources import DataSettings

    model = p.add_argument_group("model and data")
    model.add_argument("--model", required=True, metavar="M", help=_MODEL_HELP)
    add_task_flag(model)
    model.add_argument(
        "--text",
        nargs="+",
        required=True,
        metavar="PATH",
        help="UTF-8 text files; each blank-line-separated paragraph is one document, 5%% of them held out "
        "for validation",
    )
    _add_setting_flags(model, DataSettings)
    model.add_argument(
        "--tokenizer",
        metavar="JSON",
        help="a tokenizers JSON file (e.g. a pretrained model's tokenizer.json; its special tokens as the "
        "special_tokens_map.json beside it names them, else BERT's, RoBERTa's or GPT's) used as it is "
        "instead of a WordPiece vocabulary trained on your text; --vocab-size is then its size (default: "
        "a checkpoint folder's own tokenizer.json, else train one)",
    )
    model.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a WordPiece vocabulary of --vocab-size on your text even for a checkpoint folder with "
        "its own tokenizer: its embedding and output layer are then initialised anew (said in a note)",
    )
    model.add_argument(
        "--cache",
        metavar="DIR",
        help="cache of tokenizers and token blocks (default: $NUMSCOPE_CACHE, else ~/.cache/numscope)",
    )
    _add_setting_flags(p.add_argument_group("training"), TrainConfig)
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the run folder; rerunning into it resumes or reuses the run",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_inputs(args: argparse.Namespace) -> tuple[Any, Any]:
    from numscope.run.config import TrainConfig
    from numscope.run.sources import DataSettings

    data = _settings_from_flags(
        DataSettings,
        args,
        text=tuple(args.text),
        cache_dir=args.cache,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
    )
    config = _settings_from_flags(TrainConfig, args)
    return data, config


def _print_result(result: Any, out: str) -> None:
    bits = "—" if result.avg_bits is None else f"{result.avg_bits:.2f}"
    print(
        f"{result.name}: val loss {result.val_loss:.4f}, val accuracy {100 * result.val_accuracy:.2f}%, "
        f"{result.skipped_steps} skipped step(s), {bits} average bits per GEMM operand element, "
        f"{result.steps} steps in {result.wall_seconds:.0f}s"
    )
    if result.world_size > 1 and result.rank_divergence is None:
        print(f"sharded over {result.world_size} processes (FSDP2) on {result.device}")
    elif result.world_size > 1:
        print(
            f"data-parallel over {result.world_size} processes on {result.device}; largest parameter "
            f"difference between ranks at the end: {result.rank_divergence:g}"
        )
    print(f"run folder: {out}")


def _launched_as_rank_zero() -> bool:
    """Whether this process prints: not a torchrun rank other than 0 (read from the environment, as the
    process group is gone once a command returns)."""
    return os.environ.get("RANK", "0") == "0"
