"""``numscope`` on the command line: a thin face over the Python API."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat, formats


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


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


def formats_table() -> list[dict[str, str]]:
    """One row per registered format: the facts ``numscope formats`` prints."""
    rows = []
    for fmt in formats():
        rows.append(
            {
                "format": fmt.name,
                "kind": _kind(fmt),
                "bits": f"{fmt.bits_per_element:g}",
                "max": _number(fmt.max),
                "min normal": _number(fmt.min_normal),
                "min subnormal": _number(fmt.min_subnormal),
                "binades": f"{fmt.binades:.1f}",
                "inf": "yes" if fmt.has_inf else "no",
                "NaN": "yes" if fmt.has_nan else "no",
            }
        )
    return rows


def _kind(fmt: Format) -> str:
    if isinstance(fmt, BlockFormat):
        scale = "+fp32" if fmt.tensor_scale else ""
        return f"block {fmt.block_size}×{fmt.element.name}, {fmt.scale_format.name}{scale} scale"
    if isinstance(fmt, IntFormat):
        return "int"
    assert isinstance(fmt, FloatFormat)
    return f"float e{fmt.exponent_bits}m{fmt.mantissa_bits} ({fmt.special})"


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


def _cmd_formats(args: argparse.Namespace) -> int:
    print(render_table(formats_table()))
    print(
        "\nbits: per element, block-scale overhead included. Block formats: max/min through the block scale; "
        "within one block the element's range applies.\nAny eXmY (e.g. e3m4) is also accepted: IEEE-like, "
        "with inf and NaN."
    )
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from numscope.plan.recipes import recipes

    found = recipes()
    if args.name is not None:
        found = [recipe for recipe in found if recipe.name == args.name]
        if not found:
            from numscope.plan import Plan

            raise CLIError(f"unknown recipe {args.name!r}; known: {', '.join(Plan.recipes())}")
    rows = [{"recipe": r.name, "what": r.summary, "source": r.source} for r in found]
    print(render_table(rows))
    if args.name is not None:
        from numscope.plan import Plan

        recipe = found[0]
        print(f"\nemulated: {recipe.notes}\n")
        print(render_table([row._asdict() for row in Plan.recipe(recipe.name).describe()]))
    else:
        print(
            "\nTrain under one with 'numscope train --plan NAME'; 'numscope recipes NAME' shows its plan and "
            "what numscope emulates of it."
        )
    return 0


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
    return parser


def _cmd_demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from numscope.demo.main import DemoConfig, DemoError, quick_config, run_demo, summary_table
    from numscope.run.config import RunError
    from numscope.run.corpus import CorpusError, CorpusNotFoundError

    if args.task == "cnn":
        return _cnn_demo(args)
    config = quick_config(args.steps) if args.quick else DemoConfig()
    if args.steps is not None and not args.quick:
        config = replace(config, train=replace(config.train, steps=args.steps))
    if args.threads is not None:
        config = replace(config, threads=args.threads)
    sizes = {name: getattr(args, name) for name in _DEMO_SIZES if getattr(args, name) is not None}
    config = replace(config, **{k: v for k, v in sizes.items() if k != "batch_size"})
    if args.batch_size is not None:
        config = replace(config, train=replace(config.train, batch_size=args.batch_size))
    if config.hidden % config.heads:
        raise CLIError(
            f"--hidden {config.hidden} must be a multiple of --heads {config.heads} (each head gets "
            "hidden / heads dimensions)"
        )
    from numscope.run.folders import check_output_folder

    out = check_output_folder(args.out or ("runs/demo-quick" if args.quick else "runs/demo"))
    for path in args.text or ():
        if not Path(path).is_file():
            raise CLIError(f"--text {path}: no such file")
    try:
        summary = run_demo(out, config, text_paths=[Path(p) for p in args.text] if args.text else None)
    except (CorpusNotFoundError, CorpusError, DemoError, RunError) as error:
        raise CLIError(str(error)) from error
    print()
    print(render_table(summary_table(summary)))
    print(f"\nreport: {summary['report']}")
    return 0


def _cnn_demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch

    from numscope.demo.cnn import CNNConfig, noise_note, run_cnn_demo
    from numscope.run.folders import check_output_folder

    out = check_output_folder(args.out or ("runs/demo-cnn-quick" if args.quick else "runs/demo-cnn"))
    config = CNNConfig.quick() if args.quick else CNNConfig()
    if args.steps is not None:
        config = replace(config, steps=args.steps, eval_every=min(config.eval_every, args.steps))
    torch.set_num_threads(args.threads or 1)
    summary = run_cnn_demo(out, config)
    print()
    print(render_table(summary["rows"]))
    print(f"\n{noise_note(summary)}\nreport: {summary['report']}")
    return 0


def _register_demo(sub: argparse._SubParsersAction) -> None:
    from numscope.demo.main import DemoConfig

    steps, quick_steps = DemoConfig().train.steps, DemoConfig.quick().train.steps
    p = sub.add_parser(
        "demo",
        help="BERT masked LM end to end: fp32, bf16, fp16 (±loss scaling), fp8, mxfp8, int8, mxfp4, "
        "and numscope's recommended plan, with report.html",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"the same stages with {quick_steps} steps per run instead of {steps}",
    )
    p.add_argument(
        "--task",
        choices=("mlm", "cnn"),
        default="mlm",
        help="mlm: the BERT masked-LM demo (default); cnn: a CNN on scikit-learn's 8x8 digits under fp32, "
        "fp16 with and without loss scaling, fp8 and the recommended plan, 3 seeds each (about a minute)",
    )
    p.add_argument("--out", help="output folder (default runs/demo or runs/demo-quick); reruns resume there")
    p.add_argument(
        "--steps",
        type=_int_at_least(1),
        help=f"training steps per run (default {steps}, quick {quick_steps})",
    )
    p.add_argument(
        "--threads",
        type=_int_at_least(1),
        help="torch threads (default 1: on a machine shared with other processes, waiting threads spin and "
        "slow the steps down; on an idle machine more threads are faster; benchmarks/bench_train_step.py "
        "--threads N measures it)",
    )
    p.add_argument(
        "--text", nargs="+", metavar="PATH", help="your own text files instead of the Wikipedia corpus"
    )
    defaults = DemoConfig()
    size = p.add_argument_group(
        "model and data size (a folder keeps the sizes it was made with: change them with a new --out)"
    )
    for name, (least, text) in _DEMO_SIZES.items():
        default = defaults.train.batch_size if name == "batch_size" else getattr(defaults, name)
        size.add_argument(
            f"--{name.replace('_', '-')}", type=_int_at_least(least), help=f"{text} (default {default})"
        )
    p.set_defaults(func=_cmd_demo)


_DEMO_SIZES = {  # flag: (smallest value, help)
    "hidden": (1, "BERT hidden size"),
    "layers": (1, "encoder layers"),
    "heads": (1, "attention heads (must divide --hidden)"),
    "intermediate": (1, "feed-forward size"),
    "seq_len": (3, "tokens per sequence, [CLS] and [SEP] included"),
    "vocab_size": (6, "most tokens of the WordPiece vocabulary trained on the corpus (5 are special)"),
    "batch_size": (1, "sequences per step"),
}


# ------------------------------------------------------------------ the user's own work (numscope.workflow)
_MODEL_HELP = (
    "the model: a built-in tiny config (tiny-bert: masked LM; tiny-gpt2: causal LM), a directory holding a "
    "transformers config.json or such a .json file, or a Python 'module:factory' / 'file.py:factory' whose "
    "callable (given vocab_size= if it takes it) returns an nn.Module or a transformers config. Hub names "
    "(e.g. bert-base-uncased) need network access: only their config is fetched, never weights"
)


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


def _add_setting_flags(group: Any, settings: type) -> None:
    """One flag per field of the ``settings`` dataclass that :func:`numscope.run.config.setting` describes
    (``--field-name``, its type, default, bounds and help); :func:`_settings_from_flags` reads them back."""
    for item in dataclasses.fields(settings):
        if "help" not in item.metadata:
            continue
        minimum, positive = item.metadata["minimum"], item.metadata["positive"]
        if isinstance(item.default, int):
            kind = _int_at_least(int(minimum)) if minimum is not None else int
        else:
            kind = _positive_float if positive else float
        group.add_argument(
            "--" + item.name.replace("_", "-"),
            type=kind,
            default=item.default,
            metavar="N" if isinstance(item.default, int) else "X",
            help=item.metadata["help"].replace("%", "%%") + " (default: %(default)s)",
        )


def _settings_from_flags(settings: type, args: argparse.Namespace, **given: Any) -> Any:
    """The ``settings`` dataclass from the flags :func:`_add_setting_flags` added, plus ``given`` fields."""
    flagged = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings) if "help" in f.metadata}
    return settings(**flagged, **given)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    from numscope.run.config import TrainConfig
    from numscope.run.sources import DataSettings

    model = p.add_argument_group("model and data")
    model.add_argument("--model", required=True, metavar="M", help=_MODEL_HELP)
    model.add_argument(
        "--objective",
        choices=("auto", "mlm", "clm"),
        default="auto",
        help="mlm: masked LM (15%% of tokens masked, BERT); clm: causal LM (next token, GPT); auto: mlm "
        "where transformers has a masked-LM head for the config, else clm (default: %(default)s)",
    )
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

    data = _settings_from_flags(DataSettings, args, text=tuple(args.text), cache_dir=args.cache)
    config = _settings_from_flags(TrainConfig, args)
    return data, config


def _print_result(result: Any, out: str) -> None:
    bits = "—" if result.avg_bits is None else f"{result.avg_bits:.2f}"
    print(
        f"{result.name}: val loss {result.val_loss:.4f}, val accuracy {100 * result.val_accuracy:.2f}%, "
        f"{result.skipped_steps} skipped step(s), {bits} average bits per GEMM operand element, "
        f"{result.steps} steps in {result.wall_seconds:.0f}s"
    )
    if result.world_size > 1:
        print(
            f"data-parallel over {result.world_size} processes; largest parameter difference between "
            f"ranks at the end: {result.rank_divergence:g}"
        )
    print(f"run folder: {out}")


def _launched_as_rank_zero() -> bool:
    """Whether this process prints: not a torchrun rank other than 0 (read from the environment, as the
    process group is gone once a command returns)."""
    return os.environ.get("RANK", "0") == "0"


def _cmd_analyze(args: argparse.Namespace) -> int:
    from numscope import workflow

    data, config = _run_inputs(args)
    result = workflow.analyze(
        args.model,
        data,
        args.out,
        config=config,
        candidates=args.candidates,
        every=args.every,
        objective=args.objective,
        tensorboard=args.tensorboard,
        sensitivity_batches=args.sensitivity,
        sensitivity_granularity=args.sensitivity_granularity,
        progress=not args.no_progress,
    )
    if _launched_as_rank_zero():
        _print_result(result, args.out)
        print(
            f"analysis: {Path(args.out) / 'analysis'}  "
            f"(next: numscope recommend {Path(args.out) / 'analysis'})"
        )
    return 0


def _register_analyze(sub: argparse._SubParsersAction) -> None:
    from numscope.workflow import DEFAULT_CANDIDATES

    p = sub.add_parser(
        "analyze",
        help="train your model in FP32 and measure every GEMM operand in candidate formats",
        description="Train the model in FP32 on your text while an observer measures every GEMM operand "
        "(input, weight, grad_output of fprop, dgrad, wgrad) in each candidate format every K steps. Writes "
        "the run folder (run name fp32) with DIR/analysis, the input of 'numscope recommend'. Under torchrun "
        "it trains with DDP and merges the ranks' measurements at each sampled step; rank 0 writes.",
    )
    _add_run_flags(p)
    p.add_argument(
        "--candidates",
        nargs="+",
        default=list(DEFAULT_CANDIDATES),
        metavar="FORMAT",
        help="formats to measure (see 'numscope formats'); bf16, the advisor's reference, is always "
        "measured (default: %(default)s)",
    )
    p.add_argument(
        "--every",
        type=_int_at_least(1),
        default=5,
        metavar="K",
        help="measure every K-th optimizer step; measuring costs several plain steps (default: %(default)s)",
    )
    p.add_argument(
        "--sensitivity",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="after training, quantize one site at a time in each candidate and measure the loss and "
        "gradient change of the trained model on N validation batches (costs N x (1 + sites x candidates) "
        "forward and backward passes); stored with the analysis for recommend's --criterion "
        "max_loss_increase_pct=... and min_grad_cosine=...; one process only (default: 0, not measured)",
    )
    p.add_argument(
        "--sensitivity-granularity",
        choices=("site", "operand"),
        default="site",
        help="--sensitivity quantizes a whole site or one operand at a time (six times the passes; what "
        "'recommend --objective sensitivity' needs) (default: %(default)s)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="LOGDIR",
        help="also write the analysis as TensorBoard scalars to LOGDIR, one per site/gemm/operand/format/"
        "metric (needs the tensorboard package; default: none)",
    )
    p.set_defaults(func=_cmd_analyze)


def _cmd_train(args: argparse.Namespace) -> int:
    from numscope import workflow

    data, config = _run_inputs(args)
    result = workflow.train(
        args.model,
        data,
        args.out,
        plan=args.plan,
        loss_scaling=args.loss_scaling,
        init_scale=args.init_scale,
        config=config,
        objective=args.objective,
        name=args.name,
        progress=not args.no_progress,
    )
    if _launched_as_rank_zero():
        _print_result(result, args.out)
    return 0


def _register_train(sub: argparse._SubParsersAction) -> None:
    from numscope.plan import Plan
    from numscope.run.config import RunSpec
    from numscope.train.loss_scaler import LossScaler

    growth = inspect.signature(LossScaler).parameters["growth_interval"].default

    p = sub.add_parser(
        "train",
        help="train your model under a precision plan (YAML or preset) with loss scaling; torchrun-ready",
        description="Train the model on your text with every GEMM operand quantized as the plan says (FP32 "
        "master weights and accumulation). Writes DIR/log.csv, DIR/checkpoint.pt while running (a rerun "
        "resumes), DIR/result.json and DIR/model.pt. Under 'torchrun --nproc-per-node N' it trains "
        "data-parallel (DDP over gloo on CPU); only rank 0 writes. A plan with block formats (MX, NVFP4) "
        "runs numscope's torch.compile'd quantizers: the same bits, compiled in the first steps "
        "(NUMSCOPE_FAST=0 keeps them eager, NUMSCOPE_FAST=1 compiles every format).",
    )
    _add_run_flags(p)
    p.add_argument(
        "--plan",
        required=True,
        metavar="PLAN",
        help=f"a plan YAML (e.g. from 'numscope recommend'), a preset ({', '.join(Plan.presets())}) or "
        "a named recipe ('numscope recipes' lists them)",
    )
    p.add_argument(
        "--loss-scaling",
        choices=("none", "static", "dynamic"),
        default="none",
        help="none; static: multiply the loss by --init-scale; dynamic: start there, halve on inf/NaN "
        f"gradients (the step is skipped), double after {growth} clean steps (default: %(default)s)",
    )
    p.add_argument(
        "--init-scale",
        type=_positive_float,
        default=RunSpec.init_scale,
        help="the (initial) loss scale (default: %(default)g)",
    )
    p.add_argument("--name", help="the run's name in compare and report (default: the folder's name)")
    p.set_defaults(func=_cmd_train)


_CRITERIA = (
    ("max_be_ratio", "max backward error relative to the reference format's"),
    ("max_underflow_pct", "max %% of nonzeros that become 0"),
    ("max_overflow_pct", "max %% of elements that saturate or overflow"),
    ("min_sqnr_db", "min signal-to-quantization-noise ratio in dB"),
)


def _criterion_value(text: str) -> Any:
    """A criterion's value as given: a number, None for 'none'/'off', else the text itself."""
    if text.lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def _key_values(text: str, flag: str, allowed: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"{flag} {text!r}: expected KEY=VALUE pairs separated by commas")
        name = key.strip().replace("-", "_")
        if name not in allowed:
            raise CLIError(f"{flag} {text!r}: unknown criterion {name!r}; allowed: {', '.join(allowed)}")
        values[name] = value.split("|") if name == "candidates" else _criterion_value(value.strip())
    return values


def _cmd_recommend(args: argparse.Namespace) -> int:
    from numscope import workflow
    from numscope.advisor import CRITERIA, OVERRIDE_KEYS
    from numscope.analysis import Analysis

    criteria: dict[str, Any] = {}
    for name, _ in _CRITERIA:
        if hasattr(args, name):  # given on the command line; else the advisor's default applies
            criteria[name] = getattr(args, name)
    if args.bit_budget is not None:
        criteria["bit_budget"] = args.bit_budget
    if args.candidates:
        criteria["candidates"] = args.candidates
    if args.reference:
        criteria["reference"] = args.reference
    if args.per_operand:
        per_operand: dict[str, dict[str, Any]] = {}
        for item in args.per_operand:
            pattern, sep, rest = item.partition(":")
            if not sep or not pattern:
                raise CLIError(f"--per-operand {item!r}: expected GLOB:KEY=VALUE[,KEY=VALUE...]")
            per_operand.setdefault(pattern, {}).update(_key_values(rest, "--per-operand", OVERRIDE_KEYS))
        criteria["per_operand"] = per_operand
    for item in args.criterion or ():
        criteria.update(_key_values(item, "--criterion", CRITERIA))
    analysis = Analysis.load(workflow.find_analysis(args.analysis))
    gap_model = workflow.load_gap_model(args.gap_model, args.objective) if args.gap_model else None
    if args.objective == "sensitivity":
        if args.bit_budget is None:
            raise CLIError("--objective sensitivity chooses within a --bit-budget; give one")
        criteria["objective"] = workflow.sensitivity_objective(analysis, gap_model)
    elif gap_model is not None and gap_model.noise_weights():
        criteria["noise_weights"] = gap_model.noise_weights()
    plan, rows = workflow.recommend_plan(analysis, args.output, **criteria)
    print(render_table(rows))
    print(
        f"\naverage bits per GEMM operand element (weighted by operand size): "
        f"{workflow.analysis_average_bits(plan, analysis):.2f}"
    )
    if gap_model is not None:
        predicted = workflow.predicted_gap(gap_model, analysis, plan)
        print(
            f"predicted validation-loss gap to FP32: {predicted:+.4f} ± {gap_model.spread:.4f} nats "
            f"(gap model {args.gap_model}, {gap_model.features} features, fitted on {gap_model.points} "
            "calibration runs; it holds for the model and training it was fitted on)"
        )
    print(f"plan: {args.output}  (next: numscope train --plan {args.output} ...)")
    return 0


def _register_recommend(sub: argparse._SubParsersAction) -> None:
    from numscope.advisor import CRITERIA, Limits, recommend

    defaults = Limits()
    p = sub.add_parser(
        "recommend",
        help="recommend a per-operand precision plan (YAML) from an analysis, with reasons",
        description="Choose a format for every GEMM operand of the analysis: the cheapest candidate that "
        "meets every limit on every measured step (or, with --bit-budget, the least total noise within the "
        "budget). Prints the table of choices and reasons and writes the plan YAML.",
    )
    p.add_argument("analysis", help="the analysis folder (or the run folder of 'numscope analyze')")
    p.add_argument(
        "-o", "--output", default="plan.yaml", help="where to write the plan (default: %(default)s)"
    )
    for name, text in _CRITERIA:
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_limit,
            default=argparse.SUPPRESS,
            metavar="X",
            help=f"{text} (default {getattr(defaults, name):g}); 'none' switches it off",
        )
    p.add_argument(
        "--bit-budget",
        type=_positive_float,
        metavar="BITS",
        help="cap on average bits per operand element (weighted by size), solved for the least total noise",
    )
    p.add_argument(
        "--candidates", nargs="+", metavar="FORMAT", help="choose only among these measured formats"
    )
    p.add_argument(
        "--gap-model",
        metavar="JSON",
        help="a gap model (gap_model.json of 'numscope calibrate'): weights each GEMM role in the "
        "--bit-budget objective by its fitted loss impact and prints the plan's predicted gap to FP32",
    )
    p.add_argument(
        "--objective",
        choices=("noise", "sensitivity"),
        default="noise",
        help="what --bit-budget minimises: noise, the operands' relative noise power in the FP32 analysis; "
        "sensitivity, their measured gradient error when quantized alone (needs 'numscope analyze "
        "--sensitivity N --sensitivity-granularity operand'; in the plan study it ranked plans as their "
        "trained loss did, the noise objective did no better than random plans) (default: %(default)s)",
    )
    p.add_argument(
        "--reference",
        metavar="FORMAT",
        help="the format backward errors are compared to (default "
        f"{inspect.signature(recommend).parameters['reference'].default})",
    )
    p.add_argument(
        "--per-operand",
        action="append",
        metavar="GLOB:KEY=VALUE[,...]",
        help="override criteria for operands whose 'site/gemm/operand' matches GLOB, e.g. "
        "'*/wgrad/grad_output:max_underflow_pct=5,candidates=bf16|fp8_e5m2' (repeatable)",
    )
    p.add_argument(
        "--criterion",
        action="append",
        metavar="KEY=VALUE",
        help="a limit of numscope.recommend by name, e.g. max_loss_increase_pct=0.5 (needs a sensitivity "
        f"in the analysis); 'none' switches it off; allowed: {', '.join(CRITERIA)} (repeatable)",
    )
    p.set_defaults(func=_cmd_recommend)


def _cmd_compare(args: argparse.Namespace) -> int:
    from numscope import workflow

    rows, notes = workflow.comparison(args.runs, baseline=args.baseline)
    print(render_table(rows))
    print(
        "\ngap = (val loss − baseline val loss) / baseline val loss; avg bits = storage bits per GEMM "
        "operand element, weighted by a training step's operand sizes"
    )
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    return 0


def _register_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="table of finished runs: val loss/accuracy, gap to a baseline, average bits, skipped steps",
        description="Compare finished run folders of 'numscope analyze' and 'numscope train'.",
    )
    p.add_argument("runs", nargs="+", metavar="DIR", help="run folders")
    p.add_argument(
        "--baseline",
        metavar="RUN",
        help="run name or folder the gap is measured against (default: the run named fp32, else the first)",
    )
    p.set_defaults(func=_cmd_compare)


def _cmd_report(args: argparse.Namespace) -> int:
    from numscope import workflow

    command = "numscope report " + " ".join(args.runs)
    path = workflow.report(
        args.runs, args.output, analysis=args.analysis, plan=args.plan, title=args.title, command=command
    )
    print(f"report: {path}")
    return 0


def _register_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="one self-contained HTML report of finished runs, their analysis and plan",
        description="Write an HTML file (figures embedded, opens offline): the runs table and loss curves, "
        "the plan per site, and from the analysis the backward-error heatmap and operand histograms against "
        "each format's range. The gap column is relative to the run named fp32.",
    )
    p.add_argument("runs", nargs="+", metavar="DIR", help="run folders")
    p.add_argument("-o", "--output", default="report.html", help="the HTML file (default: %(default)s)")
    p.add_argument(
        "--analysis", metavar="DIR", help="analysis folder (default: the first run folder holding analysis/)"
    )
    p.add_argument(
        "--plan",
        metavar="PLAN",
        help="plan YAML shown per site (default: the first run trained from a plan file)",
    )
    p.add_argument("--title", default="numscope report", help="the report's title (default: %(default)s)")
    p.set_defaults(func=_cmd_report)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from numscope import workflow
    from numscope.vocab import GEMMS

    if args.seed != 0:
        raise CLIError("--seed: calibrate trains every seed of --seeds; pass --seeds instead")
    data, config = _run_inputs(args)
    result = workflow.calibrate(
        args.model,
        data,
        args.out,
        config,
        seeds=args.seeds,
        low=args.low,
        objective=args.objective,
        sensitivity_batches=args.sensitivity,
    )
    model = result.gap_model
    print(
        "gap ≈ "
        + " + ".join(f"{model.coefficients[g]:.4g}·noise({g})" for g in GEMMS)
        + f" nats (residual sd {model.spread:.3g}; FP32 seed noise {result.noise:.4f} nats over "
        f"{len(args.seeds)} seeds)"
    )
    fitted = result.sensitivity_model
    if fitted is not None:
        print(
            "gap ≈ "
            + " + ".join(f"{fitted.coefficients[g]:.4g}·S({g})" for g in GEMMS)
            + f" nats (S: the operands' measured gradient error squared; residual sd {fitted.spread:.3g})"
        )
    for row in result.rows:
        per_seed = ", ".join(f"{gap:+.4f}" for gap in row["gaps"])
        print(f"  {row['name']}: gap {row['gap_mean']:+.4f} nats (per seed: {per_seed})")
    objective = " --objective sensitivity" if fitted is not None else ""
    print(
        f"gap model: {result.files['gap model']}\nnext: numscope recommend {result.analysis} --gap-model "
        f"{result.files['gap model']}{objective} --bit-budget BITS ..."
    )
    return 0


def _register_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="fit a gap model on your model: what each GEMM role's quantization noise costs in loss",
        description="Trains your model in FP32 (observed) and with the low format on one GEMM role at a "
        "time (fprop, dgrad, wgrad) and everywhere, on every seed (5 × seeds runs of --steps each), and fits "
        "the gap model (numscope.study.GapModel) that 'numscope recommend --gap-model' uses to weigh "
        "the roles in a bit budget and to predict a plan's validation-loss gap before training it.",
    )
    _add_run_flags(p)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], metavar="SEED", help="(default: 0 1 2)")
    p.add_argument(
        "--low", default="mxfp4_e2m1", metavar="FORMAT", help="the format probed (default: %(default)s)"
    )
    p.add_argument(
        "--sensitivity",
        type=_int_at_least(0),
        default=2,
        metavar="N",
        help="also quantize every operand of the trained FP32 model alone in every observed format on N "
        "validation batches and fit the sensitivity gap model ('recommend --objective sensitivity'); 0 "
        "skips it (default: %(default)s)",
    )
    p.set_defaults(func=_cmd_calibrate)


STUDY_OUT = "runs/study"


def _cmd_study(args: argparse.Namespace) -> int:
    from numscope import workflow

    if args.kind == "plans":
        summary = workflow.plan_study(
            args.out if args.out != STUDY_OUT else "runs/plan_study",
            quick=args.quick,
            budgets=args.budgets,
            seeds=args.seeds,
            random_plans=args.random_plans,
            steps=args.steps,
            jobs=args.jobs,
            text=args.text,
        )
        print(summary.table)
        print("\n".join(f"{kind}: {path}" for kind, path in summary.files.items()))
        return 0
    plan_only = [
        flag
        for flag, value in (
            ("--quick", args.quick),
            ("--budgets", args.budgets),
            ("--random-plans", args.random_plans),
            ("--steps", args.steps),
            ("--jobs", args.jobs),
            ("--text", args.text),
            ("--seeds", args.seeds),
        )
        if value not in (None, False)
    ]
    if plan_only:
        raise workflow.WorkflowError(f"{', '.join(plan_only)}: only for 'numscope study plans'")
    result = workflow.study(
        args.out, dofs=args.dofs, formats=args.formats, size=args.size, trials=args.trials, seed=args.seed
    )
    print(result.table)
    if result.crossover is not None:
        print(f"INT8 (per tensor) beats FP8 E4M3 above ν ≈ {result.crossover:.3g}")
    print(f"figure: {result.png}\ntable: {result.csv}")
    return 0


def _register_study(sub: argparse._SubParsersAction) -> None:
    from numscope.study import DOFS, FORMATS, PlanStudyConfig

    p = sub.add_parser(
        "study",
        help="'synthetic' (Student-t backward error, default) or 'plans' (measured vs guessed plans)",
        description="'numscope study' (or 'study synthetic'): backward error of SIZE×SIZE products of "
        "Student-t(ν) matrices quantized in each format (Rasquinha & Tabak 2024), from heavy tails to "
        "Gaussian: printed as a table, written as a PNG and a CSV into --out. 'numscope study plans': "
        "trains the demo's BERT under numscope's plan, uniform formats, practitioners' heuristics, random "
        "and inverse allocations at several average-bit budgets over several seeds (see "
        "numscope.study.plan_study); a table, plan_study.json, pareto.png and predicted_vs_measured.png.",
    )
    p.add_argument("kind", nargs="?", choices=("synthetic", "plans"), default="synthetic", help="which study")
    p.add_argument(
        "--out",
        default=STUDY_OUT,
        metavar="DIR",
        help="output folder (default: %(default)s; runs/plan_study for 'plans'; reruns resume)",
    )
    p.add_argument("--quick", action="store_true", help="plans: a small model, 40 steps, 1 budget, 2 seeds")
    plans = PlanStudyConfig()  # the plan study's defaults, quoted from its configuration

    def listed(values: Sequence[float]) -> str:
        return " ".join(f"{value:g}" for value in values)

    p.add_argument(
        "--budgets",
        nargs="+",
        type=float,
        metavar="BITS",
        help=f"plans: bits (default: {listed(plans.budgets)})",
    )
    p.add_argument(
        "--seeds", nargs="+", type=int, metavar="SEED", help=f"plans: seeds (default: {listed(plans.seeds)})"
    )
    p.add_argument(
        "--random-plans",
        type=_int_at_least(0),
        metavar="N",
        help=f"plans: random orders (default: {plans.random_plans})",
    )
    p.add_argument(
        "--steps", type=_int_at_least(1), metavar="N", help=f"plans: steps per run (default: {plans.steps})"
    )
    p.add_argument(
        "--jobs", type=_int_at_least(1), metavar="N", help=f"plans: runs side by side (default: {plans.jobs})"
    )
    p.add_argument("--text", nargs="+", metavar="PATH", help="plans: your text files instead of the corpus")
    p.add_argument(
        "--dofs",
        nargs="+",
        type=_dof,
        default=list(DOFS),
        metavar="NU",
        help="Student-t degrees of freedom, 'inf' for Gaussian (default: %(default)s)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        default=list(FORMATS),
        metavar="FORMAT",
        help="formats, 'name:row' for per-row scaling (default: %(default)s)",
    )
    p.add_argument("--size", type=_int_at_least(1), default=512, help="matrix size (default: %(default)s)")
    p.add_argument("--trials", type=_int_at_least(1), default=2, help="trials per ν (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.set_defaults(func=_cmd_study)


def _cmd_export(args: argparse.Namespace) -> int:
    from numscope import workflow

    files, unexpressed = workflow.export_plan(args.plan, args.to, args.model, args.out, args.objective)
    for path in files:
        print(f"wrote {path}")
    if unexpressed:
        print(f"\n{args.to} cannot express {len(unexpressed)} part(s) of the plan:")
        for line in unexpressed:
            print(f"  - {line}")
    return 0


def _register_export(sub: argparse._SubParsersAction) -> None:
    from numscope.plan.export import TARGETS

    p = sub.add_parser(
        "export",
        help="write a plan for torchao, Transformer Engine or Megatron-LM, with what they cannot express",
        description="Carry a plan to a training library: torchao (a module with Float8LinearConfigs and "
        "convert(model)), te (a recipe module and TE's debug-tools YAML for the GEMMs kept high), megatron "
        "(--fp8-* flags). The model is built once, untrained, to list its Linear sites.",
    )
    p.add_argument("plan", metavar="PLAN", help="a plan YAML, a preset or a named recipe")
    p.add_argument("--to", required=True, choices=TARGETS, help="the library to write for")
    p.add_argument("--model", required=True, metavar="M", help=_MODEL_HELP)
    p.add_argument("--objective", choices=("auto", "mlm", "clm"), default="auto", help=argparse.SUPPRESS)
    p.add_argument("--out", default="export", metavar="DIR", help="output folder (default: %(default)s)")
    p.set_defaults(func=_cmd_export)


_EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _register_demo,
    _register_analyze,
    _register_recommend,
    _register_train,
    _register_compare,
    _register_report,
    _register_study,
    _register_calibrate,
    _register_export,
]

_USER_ERRORS = (
    ("numscope.workflow", "WorkflowError"),
    ("numscope.plan", "PlanError"),
    ("numscope.advisor", "AdvisorError"),
    ("numscope.analysis", "AnalysisError"),
    ("numscope.train.checkpoint", "CheckpointError"),
    ("numscope.run.corpus", "CorpusError"),
    ("numscope.run.corpus", "CorpusNotFoundError"),
    ("numscope.run.config", "RunError"),
    ("numscope.demo.main", "DemoError"),
)


def _is_user_error(error: BaseException) -> bool:
    """Errors that describe the user's input (printed in one line); any other exception is a bug."""
    if isinstance(error, CLIError):
        return True
    for module_name, class_name in _USER_ERRORS:
        module = sys.modules.get(module_name)  # an error of a module never imported cannot have been raised
        if module is not None and isinstance(error, getattr(module, class_name)):
            return True
    return False


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_attach_negative_values(parser, argv))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"numscope {args.command}: interrupted; finished work is kept on disk", file=sys.stderr)
        return 130
    except Exception as error:
        if not _is_user_error(error):
            raise
        message = " ".join(str(error).split("\n"))
        print(f"numscope {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
