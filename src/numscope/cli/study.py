"""``numscope study``: the synthetic backward-error study and the plan study."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from numscope.cli.common import _dof, _int_at_least, add_seed_list

STUDY_OUT = "runs/study"


def _cmd_study(args: argparse.Namespace) -> int:
    from numscope import workflow

    if args.kind == "plans":
        summary = workflow.plan_study(
            args.out if args.out != STUDY_OUT else "runs/plan_study",
            quick=args.quick,
            demo_model=args.demo_model,
            budgets=args.budgets,
            seeds=args.seeds,
            random_plans=args.random_plans,
            steps=args.steps,
            jobs=args.jobs,
            text=args.text,
            target=None if args.target == "emulation" else args.target,
        )
        print(summary.table)
        print("\n".join(f"{kind}: {path}" for kind, path in summary.files.items()))
        return 0
    plan_only = [
        flag
        for flag, value in (
            ("--quick", args.quick),
            ("--demo-model", args.demo_model),
            ("--budgets", args.budgets),
            ("--random-plans", args.random_plans),
            ("--steps", args.steps),
            ("--jobs", args.jobs),
            ("--text", args.text),
            ("--seed-list", args.seeds),
            ("--target", args.target),
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
    from numscope.plan.targets import TARGETS
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
    p.add_argument(
        "--demo-model",
        action="store_true",
        help="plans: the demo's model and training (vocabulary 2,000, 32-token blocks, batches of 64) for "
        "1,000 steps, the length the study's tables on it were made with; it learns more from context than "
        "the study's default (300 steps of 16 128-token blocks)",
    )
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
    add_seed_list(p, None, f"plans: the seeds each plan is trained on (default: {listed(plans.seeds)})")
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
        "--target",
        choices=tuple(TARGETS),
        metavar="STACK",
        help="plans: numscope's plan also made for this training stack (only what it runs) at every budget, "
        "trained beside the others; the FP32 run observes the stack's formats too (emulation: no stack, "
        "the default)",
    )
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
