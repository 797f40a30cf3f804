"""Where a run's model and data come from: ``--model`` (a built-in tiny config, a transformers config file or
hub name, or a ``module:factory``) resolved to a factory of fresh models with its objective, and the text,
tokenizer and blocks a run trains on, each checked with an error that names the flag and the remedy."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from numscope import distributed
from numscope.errors import NumscopeError
from numscope.plan import PlanError
from numscope.run.config import RunData, TrainConfig, setting
from numscope.run.corpus import CorpusError
from numscope.run.objectives import OBJECTIVES
from numscope.run.tokenizer import TokenizerInfo


class WorkflowError(NumscopeError, ValueError):
    """A user mistake in a workflow call: a missing file, a bad model, plan, flag or run folder."""


def _tiny_bert() -> Any:
    from transformers import BertConfig

    return BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        attn_implementation="eager",
    )


def _tiny_gpt2() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=512, attn_implementation="eager")


BUILTIN_MODELS: dict[str, Callable[[], Any]] = {"tiny-bert": _tiny_bert, "tiny-gpt2": _tiny_gpt2}
"""Tiny configs that need no file and no network: ``tiny-bert`` (masked LM, hidden 64, 2 layers, 2 heads,
FFN 256) and ``tiny-gpt2`` (causal LM, the same sizes); eager attention, so attention matmuls are sites."""


# -- models ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` is ``built-in``, ``config`` (a file or hub name) or ``factory``."""

    spec: str
    kind: str
    objective: str  # "auto", "mlm" or "clm" as asked; resolved by :meth:`build`
    config: Any = None  # a transformers config (built-in and config kinds)
    factory: Callable[..., Any] | None = None

    def build(self, tokenizer: TokenizerInfo, seq_len: int) -> tuple[Callable[[], nn.Module], str]:
        """A factory of freshly initialised models for this tokenizer and block length, and the objective.

        Raises WorkflowError when the model does not fit: too few positions for ``seq_len``, an input
        embedding smaller than the vocabulary, an objective it has no head for, or a factory that fails.
        """
        if self.factory is None:
            return _config_factory(self.spec, self.config, self.objective, tokenizer, seq_len)
        made = self._call_factory(tokenizer)
        if _is_config(made):
            return _config_factory(self.spec, made, self.objective, tokenizer, seq_len)
        objective = self.objective if self.objective != "auto" else _module_objective(self.spec, made)
        _check_embeddings(self.spec, made, tokenizer)

        def make() -> nn.Module:
            return self._call_factory(tokenizer)

        return make, objective

    def _call_factory(self, tokenizer: TokenizerInfo) -> Any:
        assert self.factory is not None
        try:
            parameters = inspect.signature(self.factory).parameters
        except (TypeError, ValueError):
            parameters = {}
        takes_vocab = "vocab_size" in parameters or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
        )
        try:
            made = self.factory(vocab_size=tokenizer.vocab_size) if takes_vocab else self.factory()
        except Exception as error:  # the user's code: report it in one line
            raise WorkflowError(
                f"--model {self.spec}: the factory raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(made, nn.Module) and not _is_config(made):
            raise WorkflowError(
                f"--model {self.spec}: the factory returned a {type(made).__name__}; it must return a "
                "torch.nn.Module or a transformers config (PretrainedConfig)"
            )
        return made


def _is_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _offline() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


_WHAT_WORKS = (
    "use a local directory holding config.json, a config .json file, a Python 'module:factory' "
    "(or 'file.py:factory'), or a built-in: " + ", ".join(BUILTIN_MODELS)
)


def resolve_model(spec: str, objective: str = "auto") -> ModelSource:
    """Find the model ``spec`` names (see the module docstring); nothing is built yet.

    objective: ``auto`` (masked LM where ``transformers`` has such a head, else causal LM), ``mlm`` or
    ``clm``.
    """
    if objective not in ("auto", *OBJECTIVES):
        raise WorkflowError(f"unknown objective {objective!r}; allowed: auto, {', '.join(OBJECTIVES)}")
    if not isinstance(spec, str) or not spec.strip():
        raise WorkflowError(f"--model must name a model; {_WHAT_WORKS}")
    if spec in BUILTIN_MODELS:
        return ModelSource(spec, "built-in", objective, config=BUILTIN_MODELS[spec]())
    path = Path(spec)
    if path.exists():
        return ModelSource(spec, "config", objective, config=_load_config(spec, path))
    if ":" in spec:
        return ModelSource(spec, "factory", objective, factory=_import_factory(spec))
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise WorkflowError(f"--model {spec}: no such file or directory; {_WHAT_WORKS}")
    if _offline():
        raise WorkflowError(
            f"--model {spec}: not a local path, a module:factory or a built-in, and as a Hugging Face hub "
            f"name it cannot be fetched with HF_HUB_OFFLINE=1; {_WHAT_WORKS}"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as error:
        raise WorkflowError(
            f"--model {spec}: cannot get its config from the Hugging Face hub ({first_line(error)}); "
            f"{_WHAT_WORKS}"
        ) from error
    return ModelSource(spec, "config", objective, config=config)


def model_path(spec: str) -> str | None:
    """The absolute path of the file or folder a ``--model`` spec names (a config, a ``file.py:factory``),
    recorded in run.json so that a run folder names its model from any working directory; None for a
    built-in, a hub name or an importable ``module:factory``."""
    if spec in BUILTIN_MODELS:
        return None
    if Path(spec).exists():
        return str(Path(spec).resolve())
    module, sep, attribute = spec.rpartition(":")
    if sep and module.endswith(".py") and Path(module).is_file():
        return f"{Path(module).resolve()}:{attribute}"
    return None


def run_model(folder: str) -> tuple[str, str, int] | None:
    """``(model spec, objective, vocabulary size)`` a run folder trained with (its run.json), so that a
    command given the folder as ``--model`` builds the model the run trained, at the vocabulary its tokenizer
    gave it; None where ``folder`` is not a run folder."""
    settings = Path(folder) / "run.json"
    if not (Path(folder).is_dir() and settings.is_file()):
        return None
    from numscope.run.folders import read_settings

    stored = read_settings(settings) or {}
    spec = stored.get("model_path") or stored.get("model")
    vocab = stored.get("vocab_size_built", (stored.get("data") or {}).get("vocab_size"))
    objective = stored.get("objective_resolved") or stored.get("objective") or "auto"
    if not isinstance(spec, str) or not isinstance(vocab, int):
        raise WorkflowError(
            f"--model {folder}: its run.json records no model and vocabulary size; give --model the model "
            "itself (a built-in, a config or a module:factory)"
        )
    if (
        spec not in BUILTIN_MODELS
        and model_path(spec) is None
        and (spec.endswith(".json") or spec.startswith((".", "/", "~")) or ".py:" in spec)
    ):
        raise WorkflowError(
            f"--model {folder}: the model its run.json records, {spec!r}, is not found from here (a path "
            "relative to where the run was started); run from that folder, or give --model the model itself"
        )
    return spec, objective, vocab


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _load_config(spec: str, path: Path) -> Any:
    from transformers import AutoConfig

    if path.is_dir() and not (path / "config.json").is_file():
        raise WorkflowError(f"--model {spec}: the directory holds no config.json; {_WHAT_WORKS}")
    if path.is_file() and path.suffix != ".json":
        raise WorkflowError(
            f"--model {spec}: a model file must be a transformers config .json; {_WHAT_WORKS}"
        )
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise WorkflowError(
            f"--model {spec}: not a usable transformers config ({first_line(error)})"
        ) from error


def _import_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise WorkflowError(f"--model {spec}: expected 'module:factory'; {_WHAT_WORKS}")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            if not file.is_file():
                raise WorkflowError(f"--model {spec}: no such Python file {module_name!r}")
            module_spec = importlib.util.spec_from_file_location(file.stem, file)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the user import
            module = importlib.import_module(module_name)
    except WorkflowError:
        raise
    except Exception as error:  # an import error or any error raised by the user's module
        raise WorkflowError(
            f"--model {spec}: cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    factory = getattr(module, attribute, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise WorkflowError(
            f"--model {spec}: module {module_name!r} has no attribute {attribute!r}; its callables: "
            f"{', '.join(public) or '(none)'}"
        )
    if not callable(factory):
        raise WorkflowError(f"--model {spec}: {attribute!r} is a {type(factory).__name__}, not a callable")
    return factory


def _config_factory(
    spec: str, config: Any, objective: str, tokenizer: TokenizerInfo, seq_len: int
) -> tuple[Callable[[], nn.Module], str]:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", "")
    masked, causal = (
        model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )
    if objective == "auto":
        objective = "mlm" if masked else "clm" if causal else ""
    if objective == "" or (objective == "mlm" and not masked) or (objective == "clm" and not causal):
        heads = [name for name, has in (("mlm", masked), ("clm", causal)) if has]
        raise WorkflowError(
            f"--model {spec}: transformers has no {objective or 'language-model'} head for model type "
            f"{model_type!r}; objectives it supports: {', '.join(heads) or 'none'}"
        )
    config = copy.deepcopy(config)
    for name in ("max_position_embeddings", "n_positions"):
        positions = getattr(config, name, None)
        if isinstance(positions, int) and positions < seq_len:
            raise WorkflowError(
                f"--model {spec}: {name}={positions} is shorter than --seq-len {seq_len}; "
                f"use --seq-len {positions} or less"
            )
    given = getattr(config, "vocab_size", None)
    if isinstance(given, int) and given != tokenizer.vocab_size and spec not in BUILTIN_MODELS:
        warnings.warn(
            f"--model {spec}: its vocab_size {given} is replaced by the tokenizer's {tokenizer.vocab_size} "
            "(--vocab-size or --tokenizer decide it; the embedding and the output layer are sized to it)",
            UserWarning,
            stacklevel=2,
        )
    config.vocab_size = tokenizer.vocab_size
    config.pad_token_id = tokenizer.pad_id
    if objective == "clm":
        config.bos_token_id, config.eos_token_id = tokenizer.cls_id, tokenizer.sep_id
        if masked:  # an encoder (e.g. BERT) as a causal LM
            config.is_decoder = True
    auto = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM

    def make() -> nn.Module:
        return auto.from_config(config)

    return make, objective


def _module_objective(spec: str, model: nn.Module) -> str:
    """mlm or clm from the class or a base class: ``…ForMaskedLM``; ``…ForCausalLM``, ``…LMHeadModel``."""
    for cls in type(model).__mro__:
        if cls.__name__.endswith("ForMaskedLM"):
            return "mlm"
        if cls.__name__.endswith(("ForCausalLM", "LMHeadModel")):
            return "clm"
    raise WorkflowError(
        f"--model {spec}: cannot tell whether a {type(model).__name__} is a masked or a causal LM; pass "
        "--objective mlm or --objective clm"
    )


def _check_embeddings(spec: str, model: nn.Module, tokenizer: TokenizerInfo) -> None:
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and rows < tokenizer.vocab_size:
        raise WorkflowError(
            f"--model {spec}: the model embeds {rows} token ids but the tokenizer trained on your text has "
            f"{tokenizer.vocab_size}; let the factory take a vocab_size argument, or pass --vocab-size {rows}"
        )


def check_interface(spec: str, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
    """One forward on a tiny batch: the model takes input_ids, attention_mask, labels; gives loss, logits."""
    try:
        with torch.no_grad():
            output = model(**batch)
    except PlanError:
        raise
    except Exception as error:
        raise WorkflowError(
            f"--model {spec}: model(input_ids=…, attention_mask=…, labels=…) failed with "
            f"{type(error).__name__}: {first_line(error)}; numscope trains transformers-style "
            "language models"
        ) from error
    for name in ("loss", "logits"):
        value = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
        if not isinstance(value, torch.Tensor):
            raise WorkflowError(
                f"--model {spec}: the model's output has no {name!r} tensor; numscope trains "
                "transformers-style language models whose output has .loss and .logits"
            )


# -- data --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSettings:
    """The text and how it becomes token blocks (sizes in tokens)."""

    text: tuple[str, ...]
    vocab_size: int = setting(
        8000, "most tokens in the WordPiece vocabulary trained (and cached) on your text", minimum=6
    )
    seq_len: int = setting(64, "tokens per sequence", minimum=3)
    val_blocks: int = setting(128, "most validation sequences scored at each evaluation", minimum=1)
    cache_dir: str | None = None  # tokenizer and block cache; default $NUMSCOPE_CACHE or ~/.cache/numscope
    tokenizer: str | None = None
    """A ``tokenizers`` JSON file (a pretrained model's ``tokenizer.json``) used as it is instead of a
    WordPiece vocabulary trained on the text; ``vocab_size`` is then the file's. It needs BERT's special
    tokens."""

    def __post_init__(self) -> None:
        if isinstance(self.text, str | os.PathLike):
            object.__setattr__(self, "text", (str(self.text),))
        object.__setattr__(self, "text", tuple(str(p) for p in self.text))
        if not self.text:
            raise WorkflowError("no text files given; pass one or more UTF-8 text files (--text PATH...)")
        for path in self.text:
            if not Path(path).is_file():
                what = "is a directory, not a file" if Path(path).is_dir() else "no such file"
                raise WorkflowError(f"--text {path}: {what}")
        check_positive("--vocab-size", self.vocab_size, minimum=6)
        check_positive("--seq-len", self.seq_len, minimum=3)
        check_positive("--val-blocks", self.val_blocks)
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", str(self.tokenizer))
            object.__setattr__(self, "vocab_size", _tokenizer_info(self.tokenizer).vocab_size)


def _tokenizer_info(path: str) -> TokenizerInfo:
    """The special-token ids and size of the tokenizer file ``path``, or a clear error."""
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise WorkflowError(
            f"--tokenizer {path}: no such file (a tokenizers JSON, e.g. a model's tokenizer.json)"
        )
    try:
        loaded = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception type for a malformed file
        raise WorkflowError(
            f"--tokenizer {path}: not a tokenizers JSON file ({first_line(error)})"
        ) from error
    try:
        return TokenizerInfo.from_tokenizer(loaded)
    except ValueError as error:
        raise WorkflowError(f"--tokenizer {path}: {error}") from error


def check_positive(flag: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkflowError(f"{flag} must be an integer ≥ {minimum}; got {value!r}")


def prepare_data(data: DataSettings) -> RunData:
    """Documents split into train/validation, the cached tokenizer, and token blocks of both splits."""
    from numscope.run.data import load_run_data

    try:
        return load_run_data(
            data.vocab_size,
            data.seq_len,
            data.val_blocks,
            data.text,
            Path(data.cache_dir) if data.cache_dir else None,
            tokenizer_file=data.tokenizer,
        )
    except CorpusError as error:  # not UTF-8, no text, too little text to split or to make blocks
        raise WorkflowError(str(error)) from error


def corpus_digest(data: DataSettings) -> str:
    from numscope.run.corpus import corpus_hash, load_corpus

    try:
        return corpus_hash(load_corpus(list(data.text)))
    except CorpusError as error:  # not UTF-8, or no text
        raise WorkflowError(str(error)) from error


def check_train_config(config: TrainConfig, data: RunData) -> None:
    for flag, value in (
        ("--steps", config.steps),
        ("--batch-size", config.batch_size),
        ("--eval-every", config.eval_every),
        ("--checkpoint-every", config.checkpoint_every),
    ):
        check_positive(flag, value)
    if config.warmup_steps < 0:
        raise WorkflowError(f"--warmup-steps must be ≥ 0; got {config.warmup_steps}")
    for flag, value in (("--lr", config.lr), ("--grad-clip", config.grad_clip)):
        if not (math.isfinite(value) and value > 0):
            raise WorkflowError(f"{flag} must be a positive number; got {value}")
    if not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
        raise WorkflowError(f"--weight-decay must be ≥ 0; got {config.weight_decay}")
    if not (math.isfinite(config.mask_probability) and 0 < config.mask_probability <= 1):
        raise WorkflowError(f"--mask-probability must be in (0, 1]; got {config.mask_probability}")
    world = distributed.world_size()
    if config.batch_size % world:
        raise WorkflowError(
            f"--batch-size {config.batch_size} (the global batch) does not divide over {world} processes"
        )
    blocks = data.train_blocks.shape[0]
    if blocks < config.batch_size:
        raise WorkflowError(
            f"--batch-size {config.batch_size} exceeds the {blocks} training blocks your text makes at "
            "this --seq-len; give more text or a smaller --batch-size"
        )
