"""``numscope demo``: the BERT demo (default) and the CNN demo (``--workload cnn``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from numscope.cli.common import CLIError, _int_at_least, _positive_float, add_renamed, render_table


def _cmd_demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from numscope.demo.claims import summary_table
    from numscope.demo.main import DemoConfig, DemoError, quick_config, run_demo
    from numscope.run.config import RunError
    from numscope.run.corpus import CorpusError, CorpusNotFoundError

    if args.workload == "cnn":
        return _cnn_demo(args)
    config = quick_config(args.steps) if args.quick else DemoConfig()
    if args.steps is not None and not args.quick:
        config = replace(config, train=replace(config.train, steps=args.steps))
    if args.threads is not None:
        config = replace(config, threads=args.threads)
    if args.jobs is not None:
        config = replace(config, jobs=args.jobs)
    if args.target is not None or args.bit_budget is not None:
        target = args.target or config.advisor.target
        if target == "emulation" and args.bit_budget is None:
            raise CLIError("--target emulation has no FP8 recipe to set the budget from; give --bit-budget")
        advisor = replace(config.advisor, target=target, bit_budget=args.bit_budget)
        config = replace(config, advisor=advisor)
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
    print()
    for claim in summary["claims"]:
        print(f"[{'held' if claim['held'] else 'NOT held'}] {claim['text']}")
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
        help="BERT masked LM end to end: fp32, bf16, fp16 with loss scaling, E5M2 gradients (±loss "
        "scaling), fp8, mxfp8, int8, mxfp4, and numscope's recommended plan, with report.html",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"the same stages with {quick_steps} steps per run instead of {steps}",
    )
    p.add_argument(
        "--workload",
        choices=("bert", "cnn"),
        default="bert",
        help="bert: the BERT masked-LM demo (default); cnn: a CNN on scikit-learn's 8x8 digits under fp32, "
        "fp16 with and without loss scaling, fp8 and the recommended plan, 3 seeds each (about a minute)",
    )
    old_names = {"mlm": "bert", "cnn": "cnn"}
    add_renamed(p, "--task", "--workload", "workload", choices=tuple(old_names), convert=old_names.get)
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
        "--jobs",
        type=_int_at_least(1),
        help="runs trained at once, each in its own process with --threads threads (default: one per "
        "--threads free cores; 1 trains every run in this process); results do not depend on it",
    )
    p.add_argument(
        "--text", nargs="+", metavar="PATH", help="your own text files instead of the Wikipedia corpus"
    )
    from numscope.plan.targets import TARGETS

    p.add_argument(
        "--target",
        choices=tuple(TARGETS),
        metavar="STACK",
        help=f"the stack the recommended plan is made for: {', '.join(TARGETS)} (default "
        f"{DemoConfig().advisor.target}; emulation needs --bit-budget, measures every candidate's "
        "sensitivity, about 3 minutes, and trains no heuristic beside the plan)",
    )
    p.add_argument(
        "--bit-budget",
        type=_positive_float,
        metavar="BITS",
        help="the recommended plan's average-bit budget (default: midway between the target's cheapest "
        "recipe and its FP8 recipe on this model)",
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
