"""``numscope export``'s verb: a plan written for a training stack, for the sites of a model."""

from __future__ import annotations

import os
from pathlib import Path

from numscope._rng import fork_rng
from numscope.errors import WorkflowError
from numscope.plan import Plan
from numscope.run.folders import check_output_folder
from numscope.run.runner import plan_and_source
from numscope.run.sources import resolve_model


def export_plan(
    plan: str, target: str, model: str, out: str | os.PathLike[str], objective: str = "auto"
) -> tuple[list[Path], list[str]]:
    """Write ``plan`` (a YAML path, preset or recipe) for ``target`` (torchao, te, megatron) for the sites
    of ``model`` (as ``--model`` takes it) into ``out``. The model is built once, untrained, and run forward
    on an example batch, as ``analyze`` runs it, so that every site a plan can name is found: the Linear
    layers and the products in forward code (attention's scores and context). Returns the files written
    and what the target cannot express (:mod:`numscope.plan.export`)."""
    from numscope.plan.export import TARGETS, ExportError, export

    if target not in TARGETS:
        raise WorkflowError(f"`target` {target}: unknown target; allowed: {', '.join(TARGETS)}")
    folder = check_output_folder(out)
    loaded, source = plan_and_source(plan)
    shapes: dict[str, tuple[int, ...]] = {}
    found = model_sites(model, objective, shapes=shapes)
    names = [name for name, _ in found]
    if plan in Plan.recipes():  # a recipe's layer choice (NVFP4's BF16 layers) needs the model's sites
        loaded = Plan.recipe(plan, names)
    loaded.check_sites(names)
    try:
        result = export(loaded, target, found, f"{Path(source).name} on {model}", shapes)
    except ExportError as error:
        raise WorkflowError(str(error)) from error
    return result.save(folder), result.unexpressed


def model_sites(
    model: str, objective: str = "auto", seq_len: int = 8, shapes: dict[str, tuple[int, ...]] | None = None
) -> list[tuple[str, str]]:
    """``(site name, kind)`` of every site of ``model`` (as ``--model`` takes it, or a run folder: the model
    that run trained, at its tokenizer's vocabulary) in call order: the model is built untrained and run
    forward once, without gradients, on a batch of ``seq_len`` random tokens (what its objective feeds it:
    input ids, attention mask). ``shapes``, when given, receives each Linear
    site's weight shape (out × in features), for the export's shape rules."""
    import torch

    from numscope.run.objectives import get_objective
    from numscope.run.sources import run_model
    from numscope.run.tokenizer import TokenizerInfo
    from numscope.sites import sites

    trained = run_model(model)
    if trained is not None:  # a run folder: the model it trained, at its tokenizer's vocabulary
        model, objective, vocab = trained
        resolved = resolve_model(model, objective)
    else:
        resolved = resolve_model(model, objective)
        vocab = int(getattr(resolved.config, "vocab_size", 0) or 1000)
    tokenizer = TokenizerInfo(vocab_size=vocab, pad_id=0, unk_id=1, cls_id=2, sep_id=3, mask_id=4)
    positions = getattr(resolved.config, "max_position_embeddings", None) or getattr(
        resolved.config, "n_positions", None
    )
    length = min(int(positions or seq_len), seq_len)
    factory, kind = resolved.build(tokenizer, length, weights=False)
    with fork_rng():
        torch.manual_seed(0)
        blocks = torch.randint(5, max(vocab, 6), (2, length))
        example = next(get_objective(kind).batches(blocks, 2, tokenizer, 0, 0))
        inputs = {key: value for key, value in example.items() if key != "labels"}
        built = factory()
        found = [(site.name, site.kind) for site in sites(built, inputs)]
    if shapes is not None:
        modules = dict(built.named_modules())
        for name, kind in found:
            weight = getattr(modules.get(name), "weight", None)
            if kind in ("linear", "conv1d") and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                shapes[name] = tuple(weight.shape)
    return found
