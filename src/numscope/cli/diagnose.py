"""``numscope localize`` and ``numscope band``: where a low-precision run's gap to FP32 comes from, and
whether a real run's gap is what the recipe's numerics do."""

from __future__ import annotations

import argparse
import sys

from numscope.cli.common import (
    _add_run_flags,
    _add_setting_flags,
    _int_at_least,
    _run_inputs,
    _settings_from_flags,
    add_renamed,
    render_table,
)

_PLAN_HELP = (
    "the plan to diagnose: a plan YAML, a preset or a named recipe ('numscope recipes' lists them); a "
    "Transformer Engine, torchao or Megatron-LM configuration becomes a YAML through the Python importers "
    "(numscope.plan.export.from_transformer_engine, from_torchao, from_megatron)"
)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cmd_localize(args: argparse.Namespace) -> int:
    from numscope.diagnose import LocalizeSettings, localize, verdict

    data, config = _run_inputs(args)
    result = localize(
        args.model,
        data,
        args.out,
        plan=args.plan,
        config=config,
        settings=_settings_from_flags(LocalizeSettings, args),
        objective=args.objective,
        progress=not args.no_progress,
        log=_log,
    )
    print(render_table(result.table()))
    print()
    print(verdict(result))
    print(
        "effect: the plan's validation loss minus the plan's with that site in FP32, per seed; beyond noise: "
        "its 95% interval lies above zero and its mean exceeds FP32's seed sd."
    )
    for kind, path in result.files.items():
        print(f"{kind}: {path}")
    return 0


def _cmd_band(args: argparse.Namespace) -> int:
    from numscope.diagnose import BandSettings, band

    data, config = _run_inputs(args)
    settings = _settings_from_flags(BandSettings, args)
    result = band(
        args.model,
        data,
        args.out,
        plan=args.plan,
        config=config,
        settings=settings,
        objective=args.objective,
        progress=not args.no_progress,
        log=_log,
    )
    last = len(result.steps) - 1
    print(
        f"{result.plan} against FP32 over {len(result.gaps)} seeds: at step {result.steps[last]} the gap is "
        f"{result.mean[last]:+.4f} nats (band {result.lower[last]:+.4f} … {result.upper[last]:+.4f}; "
        f"{int(settings.level * 100)}% for one more seed, each curve a mean of {settings.window} steps)"
    )
    at, half = result.widest()
    print(
        f"widest at step {at}: ±{half:.4f} nats around the mean gap; a jump of the gap smaller than the "
        "half-width where it happens can stay inside (more --seeds narrow the band)"
    )
    if args.compare:
        verdict = result.compare(args.compare[0], args.compare[1], key=args.loss_key)
        print(f"{args.compare[1]} against {args.compare[0]}: {verdict.says()}")
        try:
            from numscope._atomic import atomic_write_bytes
            from numscope.report.plots import band_figure

            figure = f"{args.out}/band_compared.png"
            atomic_write_bytes(
                figure,
                band_figure(
                    result.to_dict(),
                    f"{result.plan}: loss gap to FP32",
                    {"steps": verdict.steps, "gap": verdict.gap, "left_at": verdict.left_at},
                ),
            )
            result.files["compared"] = figure
        except ImportError:
            pass
    for kind, path in result.files.items():
        print(f"{kind}: {path}")
    return 0 if not args.compare or verdict.inside else 1


def _register_localize(sub: argparse._SubParsersAction) -> None:
    from numscope.diagnose import LocalizeSettings

    p = sub.add_parser(
        "localize",
        help="which GEMMs make a plan's loss gap to FP32: drift in lockstep, then each site put back in FP32",
        description="Train FP32 and the plan in lockstep (identical initialisation, batches, masks and "
        "dropout) and record, per site and step, the error the plan's casts add and how far inputs, "
        "gradients and weights drift from FP32's; then, on every seed, put the sites adding the most error "
        "back in FP32 one at a time and attribute the final validation-loss gap to them, with intervals. "
        "Names the sites whose effect lies beyond FP32's seed noise. Writes localize.json, localize.md, "
        "localize.png, drift.json, plans/ and runs/ into --out (finished runs are reused on a rerun).",
    )
    _add_run_flags(p)
    p.add_argument("--plan", required=True, metavar="PLAN", help=_PLAN_HELP)
    group = p.add_argument_group("localize")
    _add_setting_flags(group, LocalizeSettings)
    add_renamed(group, "--candidates", "--top-sites", "candidates", type=_int_at_least(0))
    add_renamed(group, "--every", "--drift-every", "every", type=_int_at_least(1))
    p.set_defaults(func=_cmd_localize)


def _register_band(sub: argparse._SubParsersAction) -> None:
    from numscope.diagnose import BandSettings

    p = sub.add_parser(
        "band",
        help="the loss gap a recipe's numerics leave to FP32 over seeds; whether your runs stay inside it",
        description="Train FP32 and the plan on several seeds and build the band one more seed's "
        "training-loss gap "
        "falls in, step by step. With --compare HIGH LOW (your own runs' loss logs: CSV with step and "
        "loss columns, or TensorBoard event files or folders) say whether their gap stays inside, or "
        "from which step it leaves: then the numerics of the recipe are not the cause. The band holds "
        "for runs like its own (model, data, training settings). Exit status 1 when the gap leaves the "
        "band. Writes band.json, band.png and runs/ into --out (finished runs are reused on a rerun).",
    )
    _add_run_flags(p)
    p.add_argument("--plan", required=True, metavar="PLAN", help=_PLAN_HELP)
    group = p.add_argument_group("band")
    _add_setting_flags(group, BandSettings)
    group.add_argument(
        "--compare",
        nargs=2,
        metavar=("HIGH", "LOW"),
        help="loss logs of your high-precision and low-precision runs (CSV or TensorBoard)",
    )
    group.add_argument(
        "--loss-key",
        metavar="NAME",
        help="the loss column (CSV) or scalar tag (TensorBoard) of --compare's logs (default: the first of "
        "loss, train_loss, train/loss, lm loss, … present)",
    )
    p.set_defaults(func=_cmd_band)
