"""Compare the local sensitivity (numscope's default) with the one-at-a-time measurement it replaces, on a
trained model of a run folder: Spearman's rank correlation over every (operand, format), per format and per
GEMM role, the share within 2x, and the wall time of each. Writes ``sensitivity_check.json`` into the run
folder. Example (the forecast's FP32 run of a GQA Llama)::

    python examples/sensitivity_check.py runs/validate_llama/forecast/fp32 --formats mxfp4_e2m1 fp8_e4m3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run", type=Path, help="a finished run folder with model.pt (analyze's, forecast's fp32)"
    )
    parser.add_argument("--formats", nargs="+", default=["mxfp4_e2m1", "fp8_e4m3"])
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument(
        "--depth-bins", type=int, nargs="+", default=[2], help="local_sensitivity's, each tried"
    )
    parser.add_argument(
        "--sample-sites",
        type=int,
        default=0,
        metavar="N",
        help="measure one at a time only N sites spread over the model (its wall time scaled to every "
        "site is then an estimate, said so in the output); 0: every site",
    )
    args = parser.parse_args()

    from scipy.stats import spearmanr

    from numscope.run import runner
    from numscope.run.config import TrainConfig
    from numscope.run.folders import read_settings
    from numscope.run.sources import DataSettings, run_model
    from numscope.sensitivity import local_sensitivity, sensitivity
    from numscope.train.checkpoint import load_checkpoint

    stored = read_settings(args.run / "run.json")
    model_spec, objective, _ = run_model(str(args.run))
    data = stored["data"]
    settings = DataSettings(
        tuple(stored["text"]),
        vocab_size=data["vocab_size"],
        seq_len=data["seq_len"],
        val_blocks=data["val_blocks"],
        tokenizer=stored.get("tokenizer_path"),
    )
    fields = TrainConfig.__dataclass_fields__
    config = TrainConfig(**{k: v for k, v in stored["train"].items() if k in fields})
    prepared, factory, resolved = runner.prepare(model_spec, settings, config, objective)
    batches = runner._sensitivity_batches(prepared, config, resolved, args.batches)
    model = factory()
    model.load_state_dict(load_checkpoint(args.run / "model.pt")["model"])
    locals_, local_seconds = {}, {}
    for bins in args.depth_bins:
        began = time.perf_counter()
        locals_[bins] = local_sensitivity(model, batches, candidates=args.formats, depth_bins=bins)
        local_seconds[bins] = time.perf_counter() - began
    local = locals_[args.depth_bins[0]]
    every_site = list(dict.fromkeys(key[0] for key in local.results))  # call order
    chosen_sites = every_site
    if 0 < args.sample_sites < len(every_site):
        step = len(every_site) / args.sample_sites
        chosen_sites = [every_site[int(i * step)] for i in range(args.sample_sites)]
    began = time.perf_counter()
    alone = sensitivity(model, batches, candidates=args.formats, granularity="operand", sites=chosen_sites)
    alone_seconds = time.perf_counter() - began
    alone_estimate = alone_seconds * len(every_site) / len(chosen_sites)
    pairs = [
        (key, label, metrics["grad_rel_error"] ** 2, local.results[key][label]["grad_rel_error"] ** 2)
        for key, per in alone.results.items()
        for label, metrics in per.items()
    ]

    def summary(selected: list) -> dict:
        truth, estimate = [p[2] for p in selected], [p[3] for p in selected]
        ratios = [e / t for t, e in zip(truth, estimate, strict=True) if t > 0]
        return {
            "n": len(selected),
            "spearman": float(spearmanr(truth, estimate).statistic),
            "within_2x": sum(0.5 <= r <= 2 for r in ratios) / max(1, len(ratios)),
        }

    by_bins = {}
    for bins, other in locals_.items():
        chosen = [(k, f, t, other.results[k][f]["grad_rel_error"] ** 2) for k, f, t, _ in pairs]
        by_bins[bins] = {**summary(chosen), "seconds": local_seconds[bins]}
    result = {
        "model": model_spec,
        "depth_bins": by_bins,
        "pairs": [["/".join(k), f, t, e] for k, f, t, e in pairs],
        "formats": args.formats,
        "operands": len(alone.results),
        "all": summary(pairs),
        "per_format": {f: summary([p for p in pairs if p[1] == f]) for f in args.formats},
        "per_gemm": {g: summary([p for p in pairs if p[0][1] == g]) for g in ("fprop", "dgrad", "wgrad")},
        "sites": {"every": len(every_site), "one_at_a_time": len(chosen_sites)},
        "seconds": {
            "local": local_seconds[args.depth_bins[0]],
            "one_at_a_time": alone_seconds,
            "one_at_a_time_every_site": alone_estimate,
            "one_at_a_time_every_site_is": "measured"
            if chosen_sites == every_site
            else "scaled from the sample",
        },
        "local_passes_per_batch": local.meta["passes_per_batch"],
    }
    (args.run / "sensitivity_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "pairs"}, indent=1))


if __name__ == "__main__":
    main()
