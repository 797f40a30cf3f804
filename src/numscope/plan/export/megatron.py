"""The plan as Megatron-LM's ``--fp8-*`` flags (:func:`to_megatron`) and back (:func:`from_megatron`)."""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from numscope._names import layer_index
from numscope.plan.export.common import Export, ExportError, _high, _linear_sites
from numscope.plan.export.te import (
    _NVFP4,
    _NVFP4_NAN,
    _nvfp4_recipe,
    _one_recipe,
    _te_recipe,
    _te_runs,
    from_transformer_engine,
)
from numscope.plan.plan import Plan
from numscope.plan.spec import SiteSpec
from numscope.vocab import GEMMS, OPERAND_KEYS, OPERANDS, Gemm


def to_megatron(
    plan: Plan,
    sites: Iterable[tuple[str, str]],
    source: str = "a numscope plan",
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> Export:
    """Megatron-LM's ``--fp8-*`` flags for ``plan``: the recipe of its quantized transformer layers and how
    many leading and trailing layers stay in BF16 (``--first-last-layers-bf16``); ``shapes`` as for TE."""
    linear, unexpressed = _linear_sites(plan, sites, "megatron", shapes)
    by_layer: dict[int, list[SiteSpec]] = {}
    for name, spec in linear.items():
        layer = layer_index(name)
        if layer is not None:
            by_layer.setdefault(layer, []).append(spec)
        elif not all(_high(spec.operand(g, o)) for g, o in OPERAND_KEYS):
            unexpressed.append(
                f"{name}: outside the transformer layers, which Megatron's fp8 flags cover; it runs in high "
                "precision (the model's own dtype)"
            )
    layers = sorted(by_layer)
    quantized = [
        layer
        for layer in layers
        if any(not _high(s.operand(g, o)) for s in by_layer[layer] for g, o in OPERAND_KEYS)
    ]
    quantized_operands = [
        (g, o, s.operand(g, o))
        for layer in quantized
        for s in by_layer[layer]
        for g, o in OPERAND_KEYS
        if not _high(s.operand(g, o))
    ]
    recipes = {_te_recipe(spec, g, o) for g, o, spec in quantized_operands}
    wgrad_high = all(
        _high(s.operand(Gemm.WGRAD, o))
        for layer in quantized
        for s in by_layer[layer]
        for o in OPERANDS[Gemm.WGRAD]
    )
    flags = []
    if quantized:
        first = [layer for layer in layers if layer < quantized[0]]
        last = [layer for layer in layers if layer > quantized[-1]]
        partly = sorted(
            {
                f"{g}/{o}"
                for layer in quantized
                for s in by_layer[layer]
                for g, o in OPERAND_KEYS
                if _high(s.operand(g, o)) and not (wgrad_high and g == Gemm.WGRAD)
            }
        )
        if partly:
            unexpressed.append(
                f"{', '.join(partly)} high inside quantized layers: Megatron quantizes every GEMM of a "
                "quantized layer (only wgrad can stay high, with --no-fp8-wgrad)"
            )
        for layer in layers:
            if quantized[0] < layer < quantized[-1] and layer not in quantized:
                unexpressed.append(
                    f"layer {layer} stays high between quantized layers: Megatron keeps only ends in BF16"
                )
        named = sorted(recipe for recipe in recipes if recipe is not None)
        recipe = _one_recipe({name: 1 for name in named})
        if None in recipes:
            unexpressed.append(
                f"some quantized operands have numerics no TE recipe has; the flags use {recipe}"
            )
        if len({r.replace("Format.E4M3", "Format.HYBRID") for r in named}) > 1:
            unexpressed.append(f"the quantized layers mix recipes {', '.join(named)}; the flags use {recipe}")
        if recipe == _NVFP4:
            nvfp4 = [(g, o, spec) for g, o, spec in quantized_operands if _te_recipe(spec, g, o) == _NVFP4]
            recipe, problems = _nvfp4_recipe(nvfp4)
            if any("nan" not in spec.format_spec().options for _, _, spec in nvfp4):
                problems.append(_NVFP4_NAN)
            unexpressed += problems
        if "QParams(" in recipe:
            unexpressed.append(
                "power-of-two scales or an amax epsilon (TE's QParams): Megatron-LM builds "
                "Float8CurrentScaling(fp8_format=...) with TE's defaults (megatron/core/fp8_utils.py); "
                "the flags give tensorwise scaling without them"
            )
        if recipe.startswith("DelayedScaling") and (first or last):
            raise ExportError(
                "delayed scaling with leading or trailing layers high: Megatron-LM's TransformerConfig "
                "rejects it ('Delayed scaling does not support first / last layer in BF16', "
                "megatron/core/transformer/transformer_config.py); keep every layer quantized or use "
                "current scaling"
            )
        kind = recipe.split("(", 1)[0]  # built with TE's defaults: no MMParams switch reaches it
        differing = sorted(
            {
                (g, s.accumulate_for(g))
                for layer in quantized
                for s in by_layer[layer]
                for g in GEMMS
                if s.accumulate_for(g) != _te_runs(kind, g) and not (wgrad_high and g == Gemm.WGRAD)
            }
        )
        for gemm, wanted in differing:
            unexpressed.append(
                f"{gemm} accumulate {wanted}: Megatron-LM builds {kind} with TE's defaults "
                f"(megatron/core/fp8_utils.py), which run {gemm} accumulating in {_te_runs(kind, gemm)}"
            )
        flags += _megatron_flags(recipe)
        if wgrad_high:
            flags.append("--no-fp8-wgrad")
        if first or last:
            flags += [
                "--first-last-layers-bf16",
                f"--num-layers-at-start-in-bf16 {len(first)}",
                f"--num-layers-at-end-in-bf16 {len(last)}",
            ]
    text = "\n".join(
        [f"# Megatron-LM flags for {source}, exported by numscope", *flags]
        + [f"# not expressed: {line}" for line in unexpressed]
    )
    return Export("megatron", {"numscope_megatron_flags.txt": text + "\n"}, unexpressed)


def _megatron_flags(recipe: str) -> list[str]:
    fmt = "hybrid" if "HYBRID" in recipe else "e4m3"
    if recipe.startswith("DelayedScaling"):
        history = re.search(r"amax_history_len=(\d+)", recipe)
        algo = re.search(r"amax_compute_algo='(\w+)'", recipe)
        margin = re.search(r"margin=(\d+)", recipe)
        return [
            f"--fp8-format {fmt}",
            "--fp8-recipe delayed",
            f"--fp8-margin {margin.group(1)}",
            f"--fp8-amax-history-len {history.group(1)}",
            f"--fp8-amax-compute-algo {algo.group(1)}",
        ]
    if recipe.startswith("MXFP8"):
        return [f"--fp8-format {fmt}", "--fp8-recipe mxfp8"]  # Megatron passes fp8_format on
    if recipe.startswith("Float8BlockScaling"):
        return ["--fp8-format e4m3", "--fp8-recipe blockwise"]
    if recipe.startswith("NVFP4"):
        switches = dict(re.findall(r"(\w+)=(True|False)", recipe))
        environment = [
            f"#   export NVTE_NVFP4_{name.upper()}={1 if value == 'True' else 0}"
            for name, value in switches.items()
        ]
        for name, value in re.findall(r"nvfp4_(4over6\w*)='(\w+)'", recipe):  # TE reads these too
            environment.append(f"#   export NVTE_NVFP4_{name.upper()}={value}")
        return [
            "--fp4-format e2m1",
            "--fp4-recipe nvfp4",
            "# Megatron-LM builds TE's NVFP4BlockScaling() with its defaults, which TE reads from the",
            "# environment when it is imported; set before launching:",
            *environment,
        ]
    return [f"--fp8-format {fmt}", "--fp8-recipe tensorwise"]


def _megatron_settings(flags: str | Iterable[str]) -> dict[str, str | bool]:
    """The ``--flag value`` pairs and ``NVTE_*`` environment settings of Megatron-LM flags (the text
    :func:`to_megatron` writes, or a list of arguments)."""
    lines = flags.splitlines() if isinstance(flags, str) else list(flags)
    words: list[str] = []
    settings: dict[str, str | bool] = {}
    for line in lines:
        line = line.strip()
        found = re.match(r"#\s*export\s+(NVTE_\w+)=(\S+)", line)
        if found:
            settings[found.group(1)] = found.group(2)
        elif not line.startswith("#"):
            words += line.split()
    for index, word in enumerate(words):
        if word.startswith("--"):
            following = words[index + 1] if index + 1 < len(words) else "--"
            settings[word] = True if following.startswith("--") else following
    return settings


def from_megatron(flags: str | Iterable[str], sites: Iterable[tuple[str, str]]) -> Plan:
    """Megatron-LM's fp8/fp4 flags (and the ``NVTE_NVFP4_*`` environment TE reads) as a plan for the model
    whose ``(site name, kind)`` pairs are ``sites``: the TE recipe Megatron-LM builds from them
    (megatron/core/fp8_utils.py, fp4_utils.py: ``Float8CurrentScaling(fp8_format=...)``,
    ``DelayedScaling`` with margin, history and algorithm, ``Float8BlockScaling``, ``MXFP8BlockScaling``,
    ``NVFP4BlockScaling()``), read as :func:`from_transformer_engine` reads it, on every Linear site of the
    transformer layers; ``--first-last-layers-bf16`` keeps the leading and trailing layers high,
    ``--no-fp8-wgrad`` wgrad; everything outside the layers stays high."""
    settings = _megatron_settings(flags)
    fp8, fp4 = settings.get("--fp8-format"), settings.get("--fp4-format")
    if fp8 and fp4:
        raise ExportError("fp4 and fp8 cannot be used simultaneously (Megatron-LM's TransformerConfig)")
    attributes: dict[str, Any] = {}
    if fp4:
        if settings.get("--fp4-recipe", "nvfp4") != "nvfp4":
            raise ExportError(f"--fp4-recipe {settings['--fp4-recipe']}: numscope reads nvfp4")
        kind = "NVFP4BlockScaling"
        for switch in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            attributes[switch] = settings.get(f"NVTE_NVFP4_{switch.upper()}", "0") == "1"
        attributes["nvfp4_4over6"] = settings.get("NVTE_NVFP4_4OVER6", "none")
        attributes["nvfp4_4over6_e4m3_use_256"] = settings.get("NVTE_NVFP4_4OVER6_E4M3_USE_256", "all")
        attributes["nvfp4_4over6_err_mode"] = settings.get("NVTE_NVFP4_4OVER6_ERR_MODE", "MAE")
    elif fp8:
        if fp8 not in ("e4m3", "hybrid"):
            raise ExportError(f"--fp8-format {fp8}: Megatron-LM allows e4m3 and hybrid")
        recipe = settings.get("--fp8-recipe", "delayed")
        kinds = {
            "delayed": "DelayedScaling",
            "tensorwise": "Float8CurrentScaling",
            "blockwise": "Float8BlockScaling",
            "mxfp8": "MXFP8BlockScaling",
        }
        if recipe not in kinds:
            raise ExportError(f"--fp8-recipe {recipe}: numscope reads {', '.join(kinds)}")
        kind = kinds[str(recipe)]
        attributes["fp8_format"] = str(fp8).upper() if kind != "Float8BlockScaling" else "E4M3"
        if kind == "DelayedScaling":
            attributes["margin"] = int(settings.get("--fp8-margin", 0))
            attributes["amax_history_len"] = int(settings.get("--fp8-amax-history-len", 1))
            attributes["amax_compute_algo"] = str(settings.get("--fp8-amax-compute-algo", "most_recent"))
    else:
        return Plan(SiteSpec())
    # the recipe object Megatron-LM builds, as TE's class (read by attribute)
    recipe_object = type(kind, (), {"__module__": "transformer_engine.common.recipe", **attributes})()
    spec = from_transformer_engine(recipe_object).default
    if settings.get("--no-fp8-wgrad"):
        spec = SiteSpec({k: v for k, v in spec.operands.items() if k[0] != Gemm.WGRAD}, spec.accumulate)
    listed = list(sites)
    layers = sorted({i for name, _ in listed if (i := layer_index(name)) is not None})
    ends = bool(settings.get("--first-last-layers-bf16"))
    first = int(settings.get("--num-layers-at-start-in-bf16", 1)) if ends else 0
    last = int(settings.get("--num-layers-at-end-in-bf16", 1)) if ends else 0
    quantized = set(layers[first : len(layers) - last])
    plan = Plan(SiteSpec())
    for name, site_kind in listed:
        if site_kind in ("linear", "conv1d") and layer_index(name) in quantized:
            plan = plan.with_rule(glob.escape(name), spec)
    return plan
