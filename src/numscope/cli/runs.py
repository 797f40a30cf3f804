"""The run verbs: ``analyze`` (FP32, observed), ``train`` (under a plan), ``compare``, ``report`` and
``export``."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

from numscope.cli.common import (
    _MODEL_HELP,
    CLIError,
    _add_run_flags,
    _add_setting_flags,
    _given_settings,
    _int_at_least,
    _launched_as_rank_zero,
    _positive_float,
    _print_result,
    _run_inputs,
    _settings_from_flags,
    add_task_flag,
    render_table,
)


def analyze_arguments(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`numscope.run.analyze` that ``numscope analyze``'s flags give (with no
    flag, the function's own defaults: a test holds them equal)."""
    return {
        "candidates": tuple(args.candidates),
        "every": args.every,
        "objective": args.objective,
        "tensorboard": args.tensorboard,
        "sensitivity": sensitivity_settings(args),
    }


def sensitivity_settings(args: argparse.Namespace, granularity: str | None = None) -> Any:
    """The :class:`numscope.run.SensitivitySettings` that the ``--sensitivity*`` flags give."""
    from numscope.run.config import SensitivitySettings

    return SensitivitySettings(
        batches=args.sensitivity,
        granularity=granularity or args.sensitivity_granularity,
        formats=sensitivity_formats(args.sensitivity_formats),
        early=args.sensitivity_early,
        method=args.sensitivity_method and args.sensitivity_method.replace("-", "_"),
    )


def _generated_flags() -> dict[str, str]:
    """``Class.field`` → flag for every :func:`numscope._settings.setting` field the CLI generates."""
    from dataclasses import fields

    from numscope._settings import flag_of
    from numscope.diagnose import BandSettings, LocalizeSettings
    from numscope.run.config import TrainConfig
    from numscope.run.sources import DataSettings
    from numscope.train.adaptive import AdaptiveConfig

    return {
        f"{cls.__name__}.{item.name}": flag_of(item)
        for cls in (TrainConfig, DataSettings, AdaptiveConfig, LocalizeSettings, BandSettings)
        for item in fields(cls)
        if "help" in item.metadata
    }


SETTING_FLAGS: dict[str, str] = {
    "SensitivitySettings.batches": "--sensitivity",
    "SensitivitySettings.granularity": "--sensitivity-granularity",
    "SensitivitySettings.formats": "--sensitivity-formats",
    "SensitivitySettings.early": "--sensitivity-early",
    "SensitivitySettings.method": "--sensitivity-method",
    "ForecastSettings.target": "--stacks",
    "ForecastSettings.seeds": "--seeds",
    "ForecastSettings.batches": "--batches",
    "ForecastSettings.val_blocks": "--measure-blocks",
    "ForecastSettings.sensitivity_batches": "--sensitivity",
    "ForecastSettings.every": "--every",
    "ForecastSettings.lr_rule": "--lr-rule",
    "ForecastSettings.around": "--around",
    **_generated_flags(),
}
"""The flag that sets each setting a :class:`numscope.errors.SettingsError` names (the CLI prints its
problem under the flag)."""


def _cmd_analyze(args: argparse.Namespace) -> int:
    from numscope import workflow

    data, config = _run_inputs(args)
    result = workflow.analyze(
        args.model, data, args.out, config=config, progress=not args.no_progress, **analyze_arguments(args)
    )
    if _launched_as_rank_zero():
        _print_result(result, args.out)
        print(
            f"analysis: {Path(args.out) / 'analysis'}  "
            f"(next: numscope recommend {Path(args.out) / 'analysis'})"
        )
    return 0


def sensitivity_formats(given: list[str]) -> str | list[str] | None:
    """--sensitivity-formats as the run layer takes it: None for 'all', 'auto', or the names."""
    if given == ["all"]:
        return None
    if given == ["auto"]:
        return "auto"
    if "all" in given or "auto" in given:
        raise CLIError("--sensitivity-formats: 'all' and 'auto' stand alone; or name formats")
    return given


def add_sensitivity_formats(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sensitivity-formats",
        nargs="+",
        default=["auto"],
        metavar="FORMAT",
        help="which candidates the sensitivity quantizes each operand in: auto, the one with the fewest bits "
        "(recommend estimates the others from it and the observer's noise ratios; a tenth of the passes); "
        "all; or the formats named (default: auto)",
    )


def _early_step(value: str) -> int | str | None:
    """--sensitivity-early: a step (an integer >= 1), auto or off."""
    if value in ("auto", "off"):
        return None if value == "off" else value
    try:
        step = int(value)
    except ValueError:
        step = 0
    if step < 1:
        raise argparse.ArgumentTypeError(f"expected a step (an integer >= 1), auto or off; got {value!r}")
    return step


def add_sensitivity_early(p: argparse.ArgumentParser) -> None:
    from numscope.run.runner import AUTO_EARLY_MIN_STEPS, AUTO_SENSITIVITY_EARLY

    p.add_argument(
        "--sensitivity-early",
        type=_early_step,
        default=None,
        metavar="STEP",
        help="also keep the model after STEP steps and measure the sensitivity on it, combined with the "
        "trained model's (each weighing alike); costs as many sensitivity passes again; auto: "
        f"step {AUTO_SENSITIVITY_EARLY} when --steps >= {AUTO_EARLY_MIN_STEPS}, else none (default: off)",
    )


def add_sensitivity_method(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sensitivity-method",
        choices=("local", "one-at-a-time"),
        default=None,
        help="local: every operand and format from a few passes per batch (each operand's error at its own "
        "GEMM, times the gain its group of GEMMs shows when quantized whole: numscope.sensitivity."
        "local_sensitivity; operands only); one-at-a-time: one pass per operand (or site) and format "
        "(default: local, one-at-a-time with --sensitivity-granularity site)",
    )


def _register_analyze(sub: argparse._SubParsersAction) -> None:
    from numscope.run.runner import AUTO_SENSITIVITY_BATCHES
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
        default=25,
        metavar="K",
        help="observe every K-th optimizer step; an observed step costs several plain steps "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--sensitivity",
        type=_int_at_least(0),
        default=None,
        metavar="N",
        help="after training, quantize one operand (or site) at a time in each candidate and measure the "
        "loss and gradient change of the trained model on N validation batches (costs N x (1 + operands x "
        "candidates) forward and backward passes); what recommend's default objective within a --bit-budget "
        "or --max-gap (sensitivity) and its --criterion max_loss_increase_pct=... / min_grad_cosine=... use; "
        f"one process only; 0 skips it (default: {AUTO_SENSITIVITY_BATCHES}, none under torchrun)",
    )
    p.add_argument(
        "--sensitivity-granularity",
        choices=("site", "operand"),
        default="operand",
        help="--sensitivity quantizes one operand or a whole site at a time (site: a sixth of the passes, "
        "enough for --criterion, not for the sensitivity objective) (default: %(default)s)",
    )
    add_sensitivity_formats(p)
    add_sensitivity_early(p)
    add_sensitivity_method(p)
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
        adaptive=_adaptive_config(args),
    )
    if _launched_as_rank_zero():
        _print_result(result, args.out)
        if args.adaptive:
            _print_adaptive(Path(args.out))
    return 0


ADAPTIVE = "adaptive_"
"""The prefix of the adaptive settings' parsed values (``args.adaptive_every``, …)."""


def _adaptive_config(args: argparse.Namespace):
    """The adaptive settings of ``train --adaptive`` (None without it; its flags alone are an error)."""
    from numscope.train.adaptive import AdaptiveConfig

    if not args.adaptive:
        given = _given_settings(AdaptiveConfig, args, ADAPTIVE)
        if given:
            raise CLIError(f"{', '.join(given)} set(s) adaptive training: add --adaptive")
        return None
    return _settings_from_flags(AdaptiveConfig, args, prefix=ADAPTIVE)


def _print_adaptive(out: Path) -> None:
    import json

    summary = json.loads((out / "adaptive.json").read_text(encoding="utf-8"))
    changes = ", ".join(f"{n} {cause}" for cause, n in sorted(summary["changes"].items())) or "none"
    print(
        f"adaptive: {summary['average_bits']:.2f} average bits over training; changes: {changes} "
        f"({out / 'plan_history.csv'}); the plan that ran last: {out / 'plan.final.yaml'}"
    )


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
        "data-parallel (DDP over gloo on CPU); only rank 0 writes. Quantizers run through numscope's native "
        "quantizers (C, built on first use; NUMSCOPE_NATIVE=0 turns them off) and, for what those do not "
        "cover in a plan with block formats, torch.compile (NUMSCOPE_FAST=0 keeps that eager): the same "
        "bits every way.",
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
    _add_adaptive_flags(p)
    p.set_defaults(func=_cmd_train)


def _add_adaptive_flags(p: argparse.ArgumentParser) -> None:
    from numscope.train.adaptive import AdaptiveConfig

    g = p.add_argument_group(
        "adaptive precision",
        "--adaptive changes the plan while training: a guard moves an operand to --fallback when its "
        "format's underflow% or overflow% (or SQNR) crosses a limit that format had met there, and back "
        "after --clear-after clean sampled steps; every --replan-every sampled steps the advisor re-solves "
        "the plan from the running model's measurements within the starting plan's average bits (an "
        "operand changes after --patience re-plans in a row choose it). Writes DIR/plan_history.csv, "
        "DIR/plan.final.yaml and DIR/adaptive.json",
    )
    g.add_argument("--adaptive", action="store_true", help="train with adaptive precision from --plan")
    _add_setting_flags(g, AdaptiveConfig, prefix=ADAPTIVE, absent=True)


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


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from numscope import workflow
    from numscope.run.config import read_result
    from numscope.run.runner import EVALUATIONS

    rows = []
    for folder in args.runs:
        scored = workflow.evaluate(folder, args.val_blocks, tokenizer=args.tokenizer)
        result = read_result(Path(folder) / "result.json")
        rows.append(
            {
                "run": result.name,
                "val loss (training's)": f"{result.val_loss:.4f}",
                f"val loss ({scored['blocks']} blocks)": f"{scored['val_loss']:.4f}",
                "val acc": f"{100 * scored['val_accuracy']:.2f}%",
            }
        )
        print(f"[evaluate] {folder}: {scored['val_loss']:.4f}", file=sys.stderr, flush=True)
    print(render_table(rows))
    print(f"\neach run's trained model (model.pt) under its plan; stored in each folder's {EVALUATIONS}")
    return 0


def _register_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="score finished runs' trained models on more validation blocks than their training evaluated",
        description="Score each finished run's trained model (model.pt) on up to --val-blocks blocks of its "
        "validation split, under the plan it trained with and the masks of its seed (at the run's own "
        "--val-blocks: its own val loss, bit for bit). Comparing plans needs many scored tokens: a masked "
        "LM's 128 blocks of 32 tokens score about 600.",
    )
    p.add_argument("runs", nargs="+", metavar="DIR", help="finished run folders")
    p.add_argument(
        "--val-blocks",
        type=_int_at_least(1),
        required=True,
        metavar="N",
        help="most validation blocks scored (the split may hold fewer: all are then scored)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="JSON",
        help="the tokenizer file of runs trained with --tokenizer (default: the path their run.json records)",
    )
    p.set_defaults(func=_cmd_evaluate)


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


def _cmd_export(args: argparse.Namespace) -> int:
    from numscope import workflow

    files, unexpressed = workflow.export_plan(args.plan, args.to, args.model, args.out, args.objective)
    for path in files:
        print(f"wrote {path}")
    if unexpressed:
        from numscope.plan.export.common import grouped

        print(f"\n{args.to} cannot express {len(unexpressed)} part(s) of the plan:")
        for line in grouped(unexpressed):
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
    p.add_argument(
        "--model",
        required=True,
        metavar="M",
        help="a run folder (the model that run trained, at its tokenizer's vocabulary: what the plan was "
        "made for) or " + _MODEL_HELP,
    )
    add_task_flag(p)
    p.add_argument("--out", default="export", metavar="DIR", help="output folder (default: %(default)s)")
    p.set_defaults(func=_cmd_export)
