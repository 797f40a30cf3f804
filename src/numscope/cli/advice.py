"""``numscope recommend`` (a plan from an analysis, with reasons) and ``numscope calibrate`` (the gap
models recommend weighs roles with)."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from numscope.cli.common import (
    CLIError,
    _add_run_flags,
    _int_at_least,
    _limit,
    _positive_float,
    _run_inputs,
    add_renamed,
    add_seed_list,
    render_table,
)

_MINIMIZE = ("auto", "noise", "sensitivity")
#: the noise objective's four limits, which once had a flag each (now --criterion NAME=X)
_CRITERIA = ("max_be_ratio", "max_underflow_pct", "max_overflow_pct", "min_sqnr_db")


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
    for name in _CRITERIA:
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
    if args.target:
        criteria["target"] = args.target
    analysis = Analysis.load(workflow.find_analysis(args.analysis))
    objective = args.objective
    why = "asked for"
    if objective == "auto":
        objective = workflow.default_objective(analysis, args.bit_budget, args.max_gap)
        why = workflow.OBJECTIVE_WHY[objective]
        limited = set(criteria) - {"target"} or args.criterion  # the classic choice: cheapest within limits
        if objective == "sensitivity" and args.bit_budget is None and args.max_gap is None and limited:
            objective, why = "noise", workflow.OBJECTIVE_WHY["noise limits"]
        noise_only = args.gap_model and not workflow.has_sensitivity_model(args.gap_model)
        if objective == "sensitivity" and noise_only:
            objective, why = "noise", workflow.OBJECTIVE_WHY["noise gap model"]
    gap_model = workflow.load_gap_model(args.gap_model, objective) if args.gap_model else None
    if args.max_gap is not None:  # checked against --gap-model and --bit-budget by recommend_plan
        criteria["max_gap"], criteria["gap_model"] = args.max_gap, gap_model
    default_budget = None
    if objective == "sensitivity":
        if args.bit_budget is None and args.max_gap is None:
            default_budget = workflow.default_budget(analysis, args.target)
            criteria["bit_budget"] = default_budget
            if args.objective == "auto":
                why = workflow.OBJECTIVE_WHY["sensitivity default budget"]
        criteria["objective"] = workflow.analysis_objective(analysis, gap_model)
        for name in _CRITERIA:  # the noise objective's guards: off unless asked for
            criteria.setdefault(name, None)
    elif gap_model is not None and gap_model.noise_weights():
        criteria["noise_weights"] = gap_model.noise_weights()
    plan, rows = workflow.recommend_plan(analysis, args.output, **criteria)
    print(render_table(rows))
    print(f"\nobjective: {objective} ({why})")
    if default_budget is not None:
        print(
            f"  bit budget: {default_budget:g} bits per operand element (the default; --bit-budget sets one)"
        )
    unmeasured = workflow.unmeasured_operands(analysis) if objective == "sensitivity" else set()
    if unmeasured:
        print(
            f"  {len(unmeasured)} of {len(analysis.keys())} operands kept high: the sensitivity did not "
            "measure them (a forecast measures only the sites its stacks convert)"
        )
    if objective == "sensitivity":
        if gap_model is not None and gap_model.role_weights():
            weights = ", ".join(f"{g} {w:.2g}" for g, w in gap_model.role_weights().items())
            print(f"  GEMM roles weighted from your calibration ({args.gap_model}): {weights}")
        else:
            print(
                "  GEMM roles weighted equally (no calibration of your model: 'numscope calibrate' measures "
                "what each role's noise costs in loss, and --gap-model weighs them by it)"
            )
        measured = [c for c in analysis.candidates if c in analysis.sensitivity.candidates]
        others = [c for c in analysis.candidates if c not in measured]
        if others:
            print(
                f"  sensitivity measured in {', '.join(measured)}; {', '.join(others)} estimated from it by "
                "the observer's noise ratio on each operand (numscope.advisor.operand_impact)"
            )
    print(
        f"average bits per GEMM operand element (weighted by operand size): "
        f"{workflow.analysis_average_bits(plan, analysis):.2f}"
    )
    if gap_model is not None:
        predicted = workflow.predicted_gap(gap_model, analysis, plan)
        target = "" if args.max_gap is None else f"; the cheapest plan predicted within {args.max_gap:g}"
        print(
            f"predicted validation-loss gap to FP32: {predicted:+.4f} ± {gap_model.spread:.4f} nats "
            f"(gap model {args.gap_model}, {gap_model.features} features, fitted on {gap_model.points} "
            f"calibration runs; it holds for the model and training it was fitted on{target})"
        )
        if outside := workflow.extrapolation(gap_model, analysis, plan):
            print(f"  {outside}")
        if objective == "sensitivity":
            print(
                "  read it as a lower bound: the plan chosen by minimising this prediction measured several "
                "times its predicted gap on the families studied (docs/results/plan-study.md)"
            )
    else:
        print(
            "predicted gap to FP32: none (no gap model; 'numscope calibrate' fits one on your model, then "
            "--gap-model predicts each plan's gap and --max-gap chooses by it)"
        )
    print(f"plan: {args.output}  (next: numscope train --plan {args.output} ...)")
    if args.target and args.target != "emulation":
        trained = args.analysis if (Path(args.analysis) / "run.json").is_file() else "M"
        print(f"export: numscope export {args.output} --to {args.target} --model {trained} --out DIR")
    return 0


def _register_recommend(sub: argparse._SubParsersAction) -> None:
    from numscope.advisor import CRITERIA, recommend
    from numscope.plan.targets import TARGETS

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
    for name in _CRITERIA:  # --criterion NAME=X says the same
        add_renamed(
            p,
            "--" + name.replace("_", "-"),
            f"--criterion {name}=X",
            name,
            type=_limit,
            default=argparse.SUPPRESS,
        )
    p.add_argument(
        "--bit-budget",
        type=_positive_float,
        metavar="BITS",
        help="cap on average bits per operand element (weighted by size), solved for the least total noise",
    )
    p.add_argument(
        "--max-gap",
        type=float,
        metavar="NATS",
        help="instead of --bit-budget: the cheapest plan whose validation-loss gap to FP32, as --gap-model "
        "predicts it, is at most NATS (bisection on the bit budget)",
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
        "--minimize",
        dest="objective",
        choices=_MINIMIZE,
        default="auto",
        help="what the plan minimises within --bit-budget: sensitivity, the operands' measured gradient "
        "error when quantized alone ('numscope analyze' measures it by default, per operand; the noise "
        "limits are off under it unless given); noise, their relative noise power in the FP32 analysis, "
        "under the limits; auto: sensitivity where the analysis measured it, else noise (default: "
        "%(default)s)",
    )
    add_renamed(p, "--objective", "--minimize", "objective", choices=_MINIMIZE)
    p.add_argument(
        "--target",
        choices=tuple(TARGETS),
        metavar="STACK",
        help="choose only what this training stack runs, so that 'numscope export --to STACK' carries the "
        f"plan whole: {', '.join(TARGETS)} (emulation: every measured format, per operand; the default)",
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


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from numscope import workflow
    from numscope.cli.runs import sensitivity_settings

    if args.seed != 0:
        raise CLIError("--seed: calibrate trains every seed of --seed-list; pass --seed-list instead")
    data, config = _run_inputs(args)
    result = workflow.calibrate_gap_model(
        args.model,
        data,
        args.out,
        config,
        seeds=args.seeds,
        low=args.low,
        also=args.also or (),
        objective=args.objective,
        jobs=args.jobs,
        sensitivity=sensitivity_settings(args, granularity="operand"),
    )
    model = result.gap_model
    print(f"gap ≈ {model.formula()}; FP32 seed noise {result.noise:.4f} nats over {len(args.seeds)} seeds")
    fitted = result.sensitivity_model
    if fitted is not None:
        print(f"gap ≈ {fitted.formula()}; S: the operands' measured gradient error squared")
    for row in result.rows:
        per_seed = ", ".join(f"{gap:+.4f}" for gap in row["gaps"])
        print(f"  {row['name']}: gap {row['gap_mean']:+.4f} nats (per seed: {per_seed})")
    objective = " --minimize sensitivity" if fitted is not None else ""
    print(
        f"gap model: {result.files['gap model']}\nnext: numscope recommend {result.analysis} --gap-model "
        f"{result.files['gap model']}{objective} --bit-budget BITS ..."
    )
    return 0


def _register_calibrate(sub: argparse._SubParsersAction) -> None:
    from numscope.cli.runs import add_sensitivity_early, add_sensitivity_formats, add_sensitivity_method

    p = sub.add_parser(
        "calibrate",
        help="fit a gap model on your model: what each GEMM role's quantization noise costs in loss",
        description="Trains your model in FP32 (observed) and with the low format on one GEMM role at a "
        "time (fprop, dgrad, wgrad) and everywhere, and each --also format everywhere, on every seed ((5 + "
        "also) × seeds runs of --steps each), and fits "
        "the gap model (numscope.study.GapModel) that 'numscope recommend --gap-model' uses to weigh "
        "the roles in a bit budget and to predict a plan's validation-loss gap before training it.",
    )
    _add_run_flags(p)
    add_seed_list(p, [0, 1, 2], "the seeds every run is trained on (default: 0 1 2)")
    p.add_argument(
        "--low", default="mxfp4_e2m1", metavar="FORMAT", help="the format probed (default: %(default)s)"
    )
    p.add_argument(
        "--also",
        nargs="+",
        metavar="FORMAT",
        help="also train each of these formats everywhere on every seed (one run per seed each), so that "
        "the gap model is calibrated on them too; recommend says when a plan's prediction extrapolates to "
        "a format not calibrated (default: none)",
    )
    add_sensitivity_formats(p)
    add_sensitivity_early(p)
    add_sensitivity_method(p)
    p.add_argument(
        "--jobs",
        type=_int_at_least(1),
        default=1,
        metavar="N",
        help="train the runs after the observed FP32 one N at a time, each in its own process with an equal "
        "share of the cores; results do not depend on it (default: %(default)s)",
    )
    p.add_argument(
        "--sensitivity",
        type=_int_at_least(0),
        default=2,
        metavar="N",
        help="also quantize every operand of the trained FP32 model alone in every observed format on N "
        "validation batches and fit the sensitivity gap model ('recommend --minimize sensitivity'); 0 "
        "skips it (default: %(default)s)",
    )
    p.set_defaults(func=_cmd_calibrate)
