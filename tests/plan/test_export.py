"""Exports to torchao, Transformer Engine and Megatron-LM, and the other way. torchao runs for real (its
emulation, in a subprocess with the torchao that ./run installs beside the venv); TE and Megatron cannot be
installed here: their files are checked against the documented API (recipe names, debug-YAML structure,
argument names) and a golden file."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numscope
from numscope.cli import main
from numscope.plan import Plan
from numscope.plan.export import (
    ExportError,
    export,
    from_transformer_engine,
    to_megatron,
    to_transformer_engine,
)
from numscope.vocab import OPERAND_KEYS
from tiny_models import tiny_bert

PEERS = Path(sys.prefix) / "peers"
HERE = Path(__file__).resolve().parent  # the subprocesses import this file's models from here
TESTS = HERE.parent  # and its helpers (tiny_models) from tests/
GOLDEN = TESTS / "golden"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def bert_sites() -> list[tuple[str, str]]:
    model = tiny_bert(layers=4, max_position=512, impl=None)
    return [
        (site.name, site.kind) for site in numscope.sites(model, {"input_ids": torch.randint(1, 100, (2, 8))})
    ]


TORCHAO_RUN = textwrap.dedent(
    """
    import dataclasses, importlib.util, json, sys, torch
    sys.path.insert(0, sys.argv[1])
    import numscope
    from numscope.plan.export import from_torchao
    from test_export import MLP
    spec = importlib.util.spec_from_file_location("exported", sys.argv[2])
    exported = importlib.util.module_from_spec(spec); spec.loader.exec_module(exported)
    plan = numscope.Plan.named(sys.argv[3])
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    # torchao's emulation accumulates in fp32 whatever use_fast_accum says ("a no-op if emulation is turned
    # on", torchao/float8/config.py): compare with the plan's operands accumulated in fp32
    want = plan.for_site("fc1")
    fp32 = plan.with_rule("fc*", numscope.SiteSpec(want.operands))
    theirs, ours = exported.convert(MLP(), emulate=True), numscope.convert(MLP(), fp32)
    results = []
    for model in (theirs, ours):
        out = model(x)
        out.square().sum().backward()
        results.append((out.detach(), model.fc1.weight.grad, model.fc2.weight.grad))
    differences = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results)]  # relative
    config = exported.configs()[0]
    # with torchao's amax floor (1e-12), which the export adds where it lacks
    floored = numscope.SiteSpec({key: dataclasses.replace(spec, scaling=dataclasses.replace(
        spec.effective_scaling(), amax_epsilon=1e-12)) for key, spec in want.operands.items()},
        want.accumulate)
    fast = [config.gemm_config_output.use_fast_accum, config.gemm_config_grad_input.use_fast_accum,
            config.gemm_config_grad_weight.use_fast_accum]
    print(json.dumps({"converted": type(theirs.fc1).__name__, "differences": differences,
                      "round_trip": from_torchao(config).for_site("fc1") == floored,
                      "floored": floored == want, "fast_accum": fast,
                      "accumulate": [want.accumulate_for(g) for g in ("fprop", "dgrad", "wgrad")]}))
    """
)


@pytest.mark.skipif(not (PEERS / "torchao").is_dir(), reason="./run installs torchao into .venv/peers")
@pytest.mark.parametrize(
    "plan,tolerance",
    [
        ("fp8", 1e-6),
        ("torchao_tensorwise", 1e-6),
        ("torchao_rowwise", 0.0),
        ("torchao_rowwise_with_gw_hp", 0.0),
    ],
)
def test_torchao_runs_the_export_as_numscope_emulates_it(plan: str, tolerance: float, tmp_path: Path) -> None:
    model = MLP()
    sites = [(site.name, site.kind) for site in numscope.sites(model, torch.randn(2, 64))]
    exported = export(Plan.named(plan), "torchao", sites, plan)
    written = exported.save(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(TORCHAO_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(PEERS), str(TESTS))), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(HERE), str(written[0]), plan]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["converted"] == "Float8Linear"
    # power-of-two scales: bit for bit; other per-tensor scales: torchao divides by the scale where numscope
    # multiplies by its reciprocal (Transformer Engine's order), which moves a value by an ulp or so
    assert max(result["differences"]) <= tolerance, result
    assert result["round_trip"]  # the torchao config read back is the plan's spec, with torchao's amax floor
    # each GEMM's accumulation written explicitly: fast (fp22) where the plan says so; torchao's recipes
    # accumulate the output GEMM fast (its default), the fp8 preset in fp32 everywhere
    assert result["fast_accum"] == [acc == "fp22" for acc in result["accumulate"]], result
    assert result["accumulate"][0] == ("fp22" if plan.startswith("torchao_") else "fp32")
    # the torchao_* recipes carry that floor; the fp8 preset has none: the export says so, in one line
    floor_lines = [line for line in exported.unexpressed if "floors every amax at 1e-12" in line]
    assert result["floored"] == plan.startswith("torchao_") and len(floor_lines) == (plan == "fp8")


class BiasFreeMLP(nn.Module):
    """torchao's MXFP8 training needs features in multiples of 32 and drops a Linear's bias (fc3 has one)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False)
        self.fc3 = nn.Linear(64, 32)

    def forward(self, x):
        return self.fc3(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


TORCHAO_MX_RUN = textwrap.dedent(
    """
    import importlib.util, json, sys, warnings, torch
    sys.path.insert(0, sys.argv[1])
    import numscope
    from numscope.plan.export import from_torchao
    from test_export import BiasFreeMLP
    spec = importlib.util.spec_from_file_location("exported", sys.argv[2])
    exported = importlib.util.module_from_spec(spec); spec.loader.exec_module(exported)
    plan = numscope.Plan.load(sys.argv[3])
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = exported.convert(BiasFreeMLP(), emulate=True)
    ours = numscope.convert(BiasFreeMLP(), plan)
    results = []
    for model in (theirs, ours):
        inputs = x.clone().requires_grad_()
        out = model(inputs)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach(), inputs.grad, model.fc1.weight.grad, model.fc2.weight.grad))
    print(json.dumps({"converted": [type(m.weight).__name__ for m in (theirs.fc1, theirs.fc2, theirs.fc3)],
                      "warned": [str(w.message) for w in caught if "bias" in str(w.message)],
                      "differences": [(a - b).abs().max().item() for a, b in zip(*results)],
                      "round_trip": from_torchao(exported.configs()[0]).for_site("fc1")
                                    == plan.for_site("fc1")}))
    """
)


#: what torchao 0.18 raises when the torch it runs on is too old for its MXFP8 training (torch 2.11 is)
TORCHAO_MX_TOO_OLD = "Please install the latest torch nightly build to use MXFP8 training"


def run_torchao_mx(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a script that trains under torchao's MXFP8 configuration; skip where torchao refuses this torch
    (its MXFP8 training needs a newer one than the oldest numscope supports), fail on any other error."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0 and TORCHAO_MX_TOO_OLD in done.stderr:
        pytest.skip(f"torchao's MXFP8 training refuses torch {torch.__version__} ({TORCHAO_MX_TOO_OLD!r})")
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.skipif(not (PEERS / "torchao").is_dir(), reason="./run installs torchao into .venv/peers")
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e4m3@rceil", "mxfp8_e4m3@even"])
@pytest.mark.parametrize("wgrad_high", [False, True])
def test_torchao_runs_the_mxfp8_export_bit_for_bit_as_numscope(
    fmt: str, wgrad_high: bool, tmp_path: Path
) -> None:
    spec = numscope.SiteSpec(
        {(g, o): ("high" if wgrad_high and g == "wgrad" else fmt) for g, o in OPERAND_KEYS}
    )
    plan = Plan(spec).with_rule("fc3", numscope.SiteSpec())
    plan.save(tmp_path / "plan.yaml")
    model = BiasFreeMLP()
    sites = [(site.name, site.kind) for site in numscope.sites(model, torch.randn(2, 64))]
    exported = export(plan.with_rule("fc3", spec), "torchao", sites)  # fc3 asked too: its bias is refused
    text = exported.files["numscope_torchao.py"]
    assert f"wgrad_with_hp={wgrad_high}" in text
    written = exported.save(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(TORCHAO_MX_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(PEERS), str(TESTS))), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        str(script),
        str(HERE),
        str(written[0]),
        str(tmp_path / "plan.yaml"),
    ]
    done = run_torchao_mx(command, env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["converted"] == ["MXFP8TrainingWeightWrapperTensor"] * 2 + ["Parameter"], result
    assert result["warned"] == ["torchao MXFP8 training drops a Linear bias; kept high: ['fc3']"]
    assert result["differences"] == [0.0, 0.0, 0.0, 0.0], result  # output, dgrad, both wgrads
    assert result["round_trip"], (
        result
    )  # the config read back (numscope.plan.export.from_torchao) is the spec


def test_torchao_mx_export_refuses_what_torchao_cannot_run() -> None:
    sites = [("fc1", "linear")]
    mixed = numscope.SiteSpec({("fprop", "input"): "mxfp8_e4m3", ("fprop", "weight"): "mxfp8_e4m3@rceil"})
    lines = export(Plan(mixed), "torchao", sites).unexpressed
    assert any("fc1: fprop/input" not in line and "mixed" in line for line in lines), lines
    assert any(line.startswith("fc1: dgrad/grad_output high") for line in lines), lines
    four = export(Plan.uniform("mxfp4"), "torchao", sites).unexpressed
    assert any(line.startswith("fc1: fprop/input mxfp4_e2m1") for line in four), four


def test_torchao_export_names_what_it_cannot_express() -> None:
    sites = bert_sites()
    exported = export(Plan.uniform("mxfp6"), "torchao", sites)
    text = exported.files["numscope_torchao.py"]
    ast.parse(text)
    assert "MODULES = {\n}" in text  # nothing torchao can run
    linear = [name for name, kind in sites if kind == "linear"]
    for name in linear:
        assert any(line.startswith(f"{name}: fprop/input mxfp6_e3m2") for line in exported.unexpressed), name
    assert any("scores (sdpa): only Linear layers are converted" in line for line in exported.unexpressed)
    mixed = Plan.uniform("fp8").with_rule("*.query", numscope.SiteSpec.uniform("fp8_e4m3"))
    two = export(mixed, "torchao", sites)  # E4M3 gradients for the queries: a second configuration
    queries = sorted(name for name in linear if name.endswith("query"))
    assert (
        f": {queries!r}," in two.files["numscope_torchao.py"]
        and "    1: [" in two.files["numscope_torchao.py"]
    )
    assert not any(line.startswith(queries[0]) for line in two.unexpressed)
    half = Plan.uniform("fp8").with_rule("*.key", numscope.SiteSpec({("fprop", "input"): "fp8_e4m3"}))
    assert any(
        line.startswith(
            "bert.encoder.layer.0.attention.self.key: fprop: one operand quantized, the other not"
        )
        for line in export(half, "torchao", sites).unexpressed
    )
    with pytest.raises(ExportError, match="unknown export target 'onnx'; allowed: torchao, te, megatron"):
        export(Plan.uniform("fp8"), "onnx", sites)


def test_transformer_engine_export_follows_the_documented_api() -> None:
    sites = bert_sites()
    names = [name for name, _ in sites]
    exported = to_transformer_engine(Plan.recipe("te_nvfp4", names), sites, "te_nvfp4")
    module = ast.parse(exported.files["numscope_te.py"])
    imported = {
        alias.name for node in module.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    used = {node.id for node in ast.walk(module) if isinstance(node, ast.Name)}
    assert imported == {"NVFP4BlockScaling"} and imported <= used  # only what the file uses
    assert (  # TE's defaults written out, as the recipe has them: RHT, stochastic rounding, 16x16 weights
        "RECIPE = NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False, "
        "disable_2d_quantization=False, nvfp4_4over6='none')" in exported.files["numscope_te.py"]
    )
    debug = yaml.safe_load(exported.files["numscope_te_debug.yaml"])
    for section in debug.values():  # TE debug tools: enabled, layers, namespaced features
        assert set(section) == {"enabled", "layers", "transformer_engine"} and section["enabled"] is True
        assert set(section["layers"]) == {"layer_name_regex_pattern"}
        feature = section["transformer_engine"]["DisableQuantizationGEMM"]  # TE >= 2.13's name
        assert feature["enabled"] is True and set(feature["gemms"]) <= {"fprop", "dgrad", "wgrad"}
    kept = {section["layers"]["layer_name_regex_pattern"] for section in debug.values()}
    assert r"^cls\.predictions\.decoder$" in kept  # the BF16 tail of the NVFP4 recipe
    # numscope's own rht16 (seed 0) has other signs than TE's transform: not TE's RHT, listed, not swapped
    seeded = Plan.from_dict(
        {"numscope_plan": 1, "default": {"all": "nvfp4", "wgrad": {"format": "nvfp4", "transform": "rht16"}}}
    )
    listed = to_transformer_engine(seeded, sites)
    wgrad = [line for line in listed.unexpressed if " wgrad/input nvfp4 " in line]
    assert wgrad and all("rht16" in line and "no TE recipe has these numerics" in line for line in wgrad)
    assert all("TE runs it under NVFP4BlockScaling(" in line for line in wgrad)  # what runs instead
    hybrid = to_transformer_engine(Plan.recipe("te_delayed"), sites)
    assert (
        "RECIPE = DelayedScaling(fp8_format=Format.HYBRID, margin=0, amax_history_len=1024"
        in hybrid.files["numscope_te.py"]
    )
    assert (
        to_transformer_engine(Plan.recipe("te_mxfp8"), sites)
        .files["numscope_te.py"]
        .count("RECIPE = MXFP8BlockScaling(fp8_format=Format.E4M3)")
        == 1
    )
    te_class = {"__module__": "transformer_engine.common.recipe"}  # read by attribute: TE's defaults
    assert from_transformer_engine(type("MXFP8BlockScaling", (), te_class)()) == Plan.recipe("te_mxfp8")


def test_megatron_flags_against_a_golden_file() -> None:
    sites = bert_sites()
    plan = Plan.uniform("fp8")
    for layer in (0, 3):  # the first and last transformer layers kept high, as --first-last-layers-bf16
        plan = plan.with_rule(f"bert.encoder.layer.{layer}.*", numscope.SiteSpec())
    exported = to_megatron(plan, sites, "fp8 with its ends high")
    text = exported.files["numscope_megatron_flags.txt"]
    assert text == (GOLDEN / "megatron_fp8_ends_high.txt").read_text()
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("--")]
    documented = {  # Megatron-LM's arguments.py, _add_transformer_engine_args
        "--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
        "--no-fp8-wgrad", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
        "--num-layers-at-end-in-bf16", "--fp4-format", "--fp4-recipe",
    }  # fmt: skip
    assert set(flags) <= documented


def test_the_cli_exports_for_a_model(tmp_path: Path, capsys) -> None:
    assert (
        main(["export", "torchao_rowwise", "--to", "torchao", "--model", "tiny-bert", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'numscope_torchao.py'}" in out and "scores (sdpa)" not in out  # kept high
    text = (tmp_path / "numscope_torchao.py").read_text()
    assert "ScalingGranularity.AXISWISE" in text and "round_scales_to_power_of_2=True" in text
    assert main(["export", "fp8", "--to", "megatron", "--model", "tiny-gpt2", "--out", str(tmp_path)]) == 0
    assert "--fp8-recipe tensorwise" in (tmp_path / "numscope_megatron_flags.txt").read_text()
    assert main(["export", "nope", "--to", "te", "--model", "tiny-bert", "--out", str(tmp_path)]) == 2
    assert "unknown preset or recipe 'nope'" in capsys.readouterr().err


def test_an_export_says_each_reason_once_with_its_modules(tmp_path: Path, capsys) -> None:
    """MXFP8 by the OCP rule on the tiny BERT: TE runs every Linear module's operands by its own rule and
    no attention product; each reason is printed once, followed by the modules it holds for. The file
    imports only the recipe classes it uses."""
    assert main(["export", "mxfp8", "--to", "te", "--model", "tiny-bert", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    reasons = [line for line in out.splitlines() if line.startswith("  - ")]
    assert out.count("only Linear layers are converted") == 1 and out.count("whose scale rounds up") == 1
    linear = next(line for line in reasons if "whose scale rounds up" in line)
    assert "(13: bert.encoder.layer.0.attention.self.query, " in linear  # 12 encoder Linears and the head's
    source = (tmp_path / "numscope_te.py").read_text()
    module = ast.parse(source)
    imported = {
        alias.name for node in module.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert imported == {"Format", "MXFP8BlockScaling"}


def test_importing_transformer_engine_recipes() -> None:
    delayed = type("DelayedScaling", (), {"fp8_format": "HYBRID", "margin": 1, "amax_history_len": 16,
                                          "amax_compute_algo": "most_recent",
                                          "__module__": "transformer_engine.common.recipe"})()  # fmt: skip
    plan = from_transformer_engine(delayed)
    spec = plan.default
    assert spec.operand("dgrad", "grad_output").format == "fp8_e5m2"
    assert spec.operand("fprop", "weight").effective_scaling().history_len == 16
    assert all(not spec.operand(*key).is_high for key in OPERAND_KEYS)
    with pytest.raises(ExportError, match="recipe of type 'CustomRecipe' is not known"):
        from_transformer_engine(type("CustomRecipe", (), {})())


class OddHead(nn.Module):
    """A head of 1000 outputs: not a multiple of 32 (torchao's MX block) nor of 16 (float8 GEMMs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.head = nn.Linear(64, 128, bias=False), nn.Linear(128, 1000, bias=False)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.fc1(x)))


TORCHAO_SHAPE_RUN = textwrap.dedent(
    """
    import importlib.util, json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_export import OddHead
    outcome = {}
    for label, path in (("checked", sys.argv[2]), ("unchecked", sys.argv[3])):
        spec = importlib.util.spec_from_file_location(label, path)
        exported = importlib.util.module_from_spec(spec); spec.loader.exec_module(exported)
        model = exported.convert(OddHead(), emulate=True)
        try:
            model(torch.randn(2, 32, 64)).square().sum().backward()
            outcome[label] = [type(m.weight).__name__ for m in (model.fc1, model.head)]
        except Exception as error:
            outcome[label] = type(error).__name__
    print(json.dumps(outcome))
    """
)


@pytest.mark.skipif(not (PEERS / "torchao").is_dir(), reason="./run installs torchao into .venv/peers")
def test_torchao_export_checks_shapes_against_the_model(tmp_path: Path) -> None:
    model = OddHead()
    sites = [(site.name, site.kind) for site in numscope.sites(model, torch.randn(2, 64))]
    shapes = {name: tuple(module.weight.shape) for name, module in model.named_modules() if name}
    plan = Plan.uniform("mxfp8")
    checked = export(plan, "torchao", sites, "mxfp8", shapes)
    assert [line for line in checked.unexpressed if line.startswith("head:")] == [
        "head: weight 1000 x 128: torchao's MX cast needs the blocked dimension "
        "(torchao/prototype/mx_formats/mx_tensor.py) in multiples of 32; the module stays in high precision"
    ]
    fp8 = export(Plan.uniform("fp8"), "torchao", sites, "fp8", shapes).unexpressed
    assert any(line.startswith("head: weight 1000 x 128:") and "multiples of 16" in line for line in fp8), fp8
    paths = [
        checked.save(tmp_path / "checked")[0],
        export(plan, "torchao", sites).save(tmp_path / "plain")[0],
    ]
    script = tmp_path / "run.py"
    script.write_text(TORCHAO_SHAPE_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(PEERS), str(TESTS))), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(HERE), *map(str, paths)]
    done = run_torchao_mx(command, env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # without the check torchao's backward fails on the head; with it the head stays high and training runs
    assert result == {
        "checked": ["MXFP8TrainingWeightWrapperTensor", "Parameter"],
        "unchecked": "AssertionError",
    }


def test_cli_export_checks_shapes_of_the_model(tmp_path: Path, capsys) -> None:
    assert main(["export", "mxfp8", "--to", "te", "--model", "tiny-bert", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # the OCP scale rule runs as TE's MXFP8 (it rounds its scale up), said once per module, not "no recipe"
    assert "RECIPE = MXFP8BlockScaling(fp8_format=Format.E4M3)" in (tmp_path / "numscope_te.py").read_text()
    assert "no TE recipe" not in out
    query = [line for line in out.splitlines() if "layer.0.attention.self.query" in line]
    assert len(query) == 1 and "6 MXFP8 operands by the OCP rule's scale" in query[0]
    assert "MXFP8BlockScaling, whose scale rounds up" in query[0]
    assert "cls.predictions.decoder: weight 30522 x 64: TE's MXFP8 quantizer needs both dimensions" in out
    assert main(["export", "fp8", "--to", "megatron", "--model", "tiny-bert", "--out", str(tmp_path)]) == 0
    assert "weight 30522" not in capsys.readouterr().out  # Megatron's flags leave the output layer high


TORCHAO_ROUND_TRIP = textwrap.dedent(
    """
    import dataclasses, importlib.util, json, sys
    sys.path.insert(0, sys.argv[1])
    import numscope
    from numscope.plan import Plan
    from numscope.plan.export import from_torchao, to_torchao
    from numscope.plan.presets import _PRESETS
    from numscope.plan.recipes import RECIPES
    from numscope.vocab import OPERAND_KEYS
    from test_export import bert_sites
    WIDE = ("fp32", "tf32", "bf16", "fp16")
    sites = bert_sites()
    names = [site for site, _ in sites]
    problems, compared = [], {}
    for name in sorted(_PRESETS) + sorted(RECIPES):
        plan = Plan.named(name, names)
        exported = to_torchao(plan, sites, name)
        path = f"{sys.argv[2]}/{name}.py"
        open(path, "w").write(exported.files["numscope_torchao.py"])
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
        of_module = {m: module.configs()[i] for i, ms in module.MODULES.items() for m in ms}
        listed = "\\n".join(exported.unexpressed)
        floor = "floors every amax at 1e-12" in listed
        for site, kind in sites:
            if kind != "linear":
                continue
            wanted = plan.for_site(site)
            if site not in of_module:  # left in high precision by the export
                high = all(wanted.operand(*k).is_high or (wanted.operand(*k).format in WIDE
                           and wanted.operand(*k).scaling is None) for k in OPERAND_KEYS)
                if not high and site not in listed:
                    problems.append([name, site, "kept high, not listed"])
                continue
            got = from_torchao(of_module[site]).for_site(site)
            compared[name] = compared.get(name, 0) + 1
            if floor:  # the one model-wide line: torchao's amax floor added to the plan's
                wanted = numscope.SiteSpec({k: dataclasses.replace(v, scaling=dataclasses.replace(
                    v.effective_scaling(), amax_epsilon=1e-12)) for k, v in wanted.operands.items()},
                    wanted.accumulate)
            for key in OPERAND_KEYS:
                w, g = wanted.operand(*key), got.operand(*key)
                same = (w.is_high and g.is_high) or (w == g and (w.is_high or
                        wanted.accumulate_for(key[0]) == got.accumulate_for(key[0])))
                if not same and site not in listed:
                    problems.append([name, site, "/".join(key), str(w), str(g)])
    print(json.dumps({"problems": problems, "compared": compared}))
    """
)


@pytest.mark.skipif(not (PEERS / "torchao").is_dir(), reason="./run installs torchao into .venv/peers")
def test_torchao_exports_of_every_preset_and_recipe_import_back_or_are_listed(tmp_path: Path) -> None:
    """Every preset and named recipe exported to torchao, executed with torchao itself and read back
    (from_torchao): each converted Linear equals the plan operand by operand (and in accumulation), and
    each module left high is listed by name (issue 26)."""
    script = tmp_path / "round_trip.py"
    script.write_text(TORCHAO_ROUND_TRIP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(PEERS), str(TESTS))), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(HERE), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["problems"] == []
    # torchao converts (and so the test compares) the Linear layers of its own recipes and of fp8
    assert all(
        result["compared"].get(name, 0) >= 20 for name in ("fp8", "torchao_tensorwise", "torchao_rowwise")
    )


#: what a listed line says runs instead of the plan's numerics (issue 46: a user reading the list must not
#: guess whether an operand stays high or runs under another recipe)
RUNS_INSTEAD = (
    "stays in high precision",  # torchao/TE: the module (or site) is not converted
    "runs in high precision",  # Megatron: outside the layers its flags cover
    "TE runs it under",  # TE: the operand runs under the file's recipe, named in full
    "run under TE's",  # TE: MXFP8 by the OCP rule runs as MXFP8BlockScaling
    "the GEMM runs quantized",  # TE: a high operand beside a quantized one
    "converted with torchao's",  # torchao: its amax floor
    "leaves such a module in high precision",  # torchao: MXFP8 with a bias
    "the flags use",  # Megatron: the recipe its flags build
    "the flags give",
    "which run",  # Megatron: TE's default accumulation
    "quantizes every GEMM",  # Megatron: no GEMM of a quantized layer stays high
    "TE makes",  # NVFP4 without @nan: what TE does with a NaN
    "Megatron cannot keep one module high",
)


@pytest.mark.parametrize("target", ["te", "torchao", "megatron"])
def test_every_listed_operand_says_what_runs_instead(target: str) -> None:
    """Every preset and named recipe exported to each target: each line of what the target cannot carry
    says what the written file makes run instead (high precision, or which recipe), never only what is
    missing."""
    from numscope.plan.presets import _PRESETS
    from numscope.plan.recipes import RECIPES

    sites = bert_sites()
    names = [name for name, _ in sites]
    listed = 0
    for name in (*_PRESETS, *RECIPES):
        exported = export(Plan.resolve(name, names), target, sites, name)
        for line in exported.unexpressed:
            listed += 1
            assert any(phrase in line for phrase in RUNS_INSTEAD), f"{name} -> {target}: {line}"
    assert listed > 0
