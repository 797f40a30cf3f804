"""``numscope forecast``: every recipe of a training stack and numscope's plans, predicted on your model
from one observed FP32 run."""

from __future__ import annotations

import argparse
import sys

from numscope.cli.common import _add_run_flags, _int_at_least, _run_inputs, add_renamed, render_table


def _cmd_forecast(args: argparse.Namespace) -> int:
    from numscope.forecast import ForecastSettings, forecast
    from numscope.forecast.run import _AROUND_SAYS

    data, config = _run_inputs(args)
    for index, target in enumerate(args.stacks):
        settings = ForecastSettings(
            target=target,
            seeds=args.seeds,
            batches=args.batches,
            val_blocks=args.measure_blocks,
            sensitivity_batches=args.sensitivity,
            every=args.every,
            lr_rule=args.lr_rule,
            around=args.around,
        )
        result = forecast(
            args.model,
            data,
            args.out,
            config=config,
            settings=settings,
            objective=args.objective,
            progress=not args.no_progress,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
        if len(args.stacks) > 1:
            print(("\n" if index else "") + f"{target}: its recipes and numscope's plans for it")
        print(render_table(result.table()))
        noise = "not measured (--seeds 1)" if result.noise is None else f"{result.noise:.4f} nats"
        print(
            f"\nFP32 validation loss per seed: {', '.join(f'{v:.4f}' for v in result.fp32_losses)}; "
            f"seed sd {noise}; "
            f"'beyond noise': the predicted gap exceeds 2 sd. Interval: the measurement's spread and the "
            "predictor's factor 2 (docs/forecast.md: how the predictions compared with trained runs)."
        )
        print(_AROUND_SAYS[result.around] + " --around chooses.")
        for line in result.limits():
            print(line)
        print(
            f"took {result.seconds['total']:.0f}s: "
            + ", ".join(f"{name} {value:.0f}s" for name, value in result.seconds.items() if name != "total")
        )
        for kind, path in result.files.items():
            print(f"{kind}: {path}")
    return 0


def _stacks(value: str) -> list[str]:
    """``--stacks``: one training stack, several separated by commas, or ``all``."""
    from numscope.plan.targets import STACKS

    names = list(STACKS) if value.strip() == "all" else [v.strip() for v in value.split(",") if v.strip()]
    unknown = [name for name in names if name not in STACKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{value!r}: a training stack ({', '.join(STACKS)}), several separated by commas, or all"
        )
    return list(dict.fromkeys(names))


def _register_forecast(sub: argparse._SubParsersAction) -> None:
    from numscope.forecast import ForecastSettings
    from numscope.forecast.run import AROUND
    from numscope.plan.targets import STACKS

    defaults = ForecastSettings()
    p = sub.add_parser(
        "forecast",
        help="predict every recipe of a training stack (and numscope's plans) on your model from one FP32 "
        "run",
        description="Fine-tune your model briefly in FP32 (observed), then put every recipe of a training "
        "stack and numscope's own plans at two budgets side by side: each with its average bits, its loss "
        "gap to FP32 predicted from that run alone (the loss its forward adds to the trained model, plus the "
        "update noise its gradient error adds, weighed by Adam's preconditioner), an interval, whether the "
        "gap lies beyond FP32's seed noise and which GEMMs stay high. Writes the FP32 runs into --out and, "
        "per stack, forecast.json, forecast.md, forecast.png and every plan's YAML into --out/STACK "
        "(--out/STACK-fp32 with --around fp32); finished runs and measurements are reused on a rerun, and "
        "by a forecast of another stack into the same --out.",
    )
    _add_run_flags(p)
    group = p.add_argument_group("forecast")
    group.add_argument(
        "--stacks",
        type=_stacks,
        default=[defaults.target],
        metavar="STACK[,STACK]",
        help=f"the training stacks whose recipes are forecast ({', '.join(STACKS)}), separated by commas, "
        "or all: the FP32 runs are shared, each stack adds its plans' measurement "
        f"(default: {defaults.target})",
    )
    add_renamed(group, "--target", "--stacks", "stacks", type=_stacks)
    group.add_argument(
        "--seeds",
        type=_int_at_least(1),
        default=defaults.seeds,
        metavar="N",
        help="FP32 runs, the first observed; 2 or more measure the seed noise each gap is judged "
        "against (default: %(default)s)",
    )
    group.add_argument(
        "--batches",
        type=_int_at_least(1),
        default=defaults.batches,
        metavar="N",
        help="training batches each plan's gradient error is measured on (default: %(default)s)",
    )
    group.add_argument(
        "--measure-blocks",
        type=_int_at_least(1),
        default=defaults.val_blocks,
        metavar="N",
        help="validation blocks each plan's forward loss change is measured on (default: as many as score "
        "2,048 tokens: 15%% of a masked LM's block, every token of a causal LM's)",
    )
    group.add_argument(
        "--sensitivity",
        type=_int_at_least(1),
        default=defaults.sensitivity_batches,
        metavar="N",
        help="validation batches of the local sensitivity numscope's plans are chosen from "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--every",
        type=_int_at_least(1),
        default=defaults.every,
        metavar="K",
        help="observe every K-th step (default: %(default)s)",
    )
    group.add_argument(
        "--lr-rule",
        choices=("mean", "final", "peak"),
        default=defaults.lr_rule,
        help="the learning rate the update noise is weighed with: the run's mean, final or peak "
        "rate (default: %(default)s)",
    )
    group.add_argument(
        "--around",
        choices=AROUND,
        default=defaults.around,
        help="what runs around the GEMMs a plan quantizes and the GEMMs it keeps high: bf16, as the stacks "
        "train under BF16 autocast (counted as 16 bits), or fp32, as `numscope train --plan te_current` "
        "does (default: %(default)s)",
    )
    p.set_defaults(func=_cmd_forecast)
