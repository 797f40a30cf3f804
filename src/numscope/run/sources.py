"""Where a run's model and data come from: ``--model`` (a built-in config, a checkpoint folder, a
transformers config file or hub name, or a ``module:factory``) resolved to a factory of models with its
objective, and the text, tokenizer and blocks a run trains on, each checked with an error that names the flag
and the remedy.

A **checkpoint folder** (``config.json`` beside ``model.safetensors`` or ``pytorch_model.bin``, sharded or
not: any Hugging Face checkpoint) gives models that start from its weights, bit for bit; the tensors it lacks
(a masked-LM head a sentence encoder was saved without) are initialised from the run's seed, and one note
says which. Its ``tokenizer.json`` is the run's tokenizer unless another is asked for; its vocabulary is
never replaced silently (``train_tokenizer``, ``--train-tokenizer``: a WordPiece vocabulary trained on the
text, the embedding and output layer then initialised anew, said in a note)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from numscope import distributed
from numscope._settings import check_settings, setting
from numscope.errors import SettingsError, WorkflowError
from numscope.plan import PlanError
from numscope.run.config import RunData, TrainConfig
from numscope.run.corpus import CorpusError
from numscope.run.objectives import OBJECTIVES
from numscope.run.tokenizer import TokenizerInfo


def _bert(**sizes: Any) -> Any:
    """A BertConfig of 2 layers with eager attention (its matmuls are sites) and ``sizes`` on top."""
    from transformers import BertConfig

    return BertConfig(num_hidden_layers=2, max_position_embeddings=512, attn_implementation="eager", **sizes)


def _tiny_bert() -> Any:
    return _bert(hidden_size=64, num_attention_heads=2, intermediate_size=256)


def _tiny_gpt2() -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=512, attn_implementation="eager")


def _demo_bert() -> Any:
    return _bert(
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


BUILTIN_MODELS: dict[str, Callable[[], Any]] = {
    "tiny-bert": _tiny_bert,
    "tiny-gpt2": _tiny_gpt2,
    "demo-bert": _demo_bert,
}
"""Configs that need no file and no network: ``tiny-bert`` (masked LM, hidden 64, 2 layers, 2 heads, FFN
256), ``tiny-gpt2`` (causal LM, the same sizes) and ``demo-bert`` (the demo's BERT shape: hidden 128, 2
layers, 4 heads, FFN 256, no dropout; its MLM head on every position); eager attention, so attention matmuls
are sites."""


# -- models ------------------------------------------------------------------------------------------
WEIGHT_FILES: tuple[str, ...] = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The files whose presence beside ``config.json`` makes a folder a checkpoint (Hugging Face's names)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` is ``built-in``, ``checkpoint`` (a folder with weights),
    ``config`` (a config file, a folder without weights, or a hub name) or ``factory``."""

    spec: str
    kind: str
    objective: str  # "auto", "mlm" or "clm" as asked; resolved by :meth:`build`
    config: Any = None  # a transformers config (built-in, checkpoint and config kinds)
    factory: Callable[..., Any] | None = None

    @property
    def tokenizer_file(self) -> str | None:
        """A checkpoint folder's own ``tokenizer.json`` (None: not a checkpoint, or it has none)."""
        if self.kind != "checkpoint":
            return None
        file = Path(self.spec) / "tokenizer.json"
        return str(file) if file.is_file() else None

    def build(
        self,
        tokenizer: TokenizerInfo,
        seq_len: int,
        *,
        replace_vocabulary: bool = False,
        weights: bool = True,
    ) -> tuple[Callable[[], nn.Module], str]:
        """A factory of models for this tokenizer and block length, and the objective: freshly initialised,
        or for a checkpoint its weights (read once here; ``weights=False``: its architecture only, e.g. to
        list its sites) with what it lacks initialised by each call; ``replace_vocabulary``: a checkpoint
        whose tokenizer was trained anew, its embedding and output layer sized to it and initialised.

        Raises WorkflowError when the model does not fit: too few positions for ``seq_len``, an input
        embedding smaller than the vocabulary, an objective it has no head for, or a factory that fails.
        """
        if self.kind == "checkpoint":
            return _checkpoint_factory(
                self.spec, self.config, self.objective, tokenizer, seq_len, replace_vocabulary, weights
            )
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
                f"`model` {self.spec}: the factory raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(made, nn.Module) and not _is_config(made):
            raise WorkflowError(
                f"`model` {self.spec}: the factory returned a {type(made).__name__}; it must return a "
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
    "use a checkpoint folder (config.json and its weights), a folder holding config.json or a config "
    ".json file (random weights), a Python 'module:factory' (or 'file.py:factory'), or a built-in: "
    + ", ".join(BUILTIN_MODELS)
)


def resolve_model(spec: str, objective: str = "auto") -> ModelSource:
    """Find the model ``spec`` names (see the module docstring); nothing is built yet.

    objective: ``auto`` (masked LM where ``transformers`` has such a head, else causal LM), ``mlm`` or
    ``clm``.
    """
    if objective not in ("auto", *OBJECTIVES):
        raise WorkflowError(f"unknown objective {objective!r}; allowed: auto, {', '.join(OBJECTIVES)}")
    if not isinstance(spec, str) or not spec.strip():
        raise WorkflowError(f"`model` must name a model; {_WHAT_WORKS}")
    if spec in BUILTIN_MODELS:
        return ModelSource(spec, "built-in", objective, config=BUILTIN_MODELS[spec]())
    path = Path(spec)
    if path.exists():
        kind = "checkpoint" if checkpoint_weights(path) is not None else "config"
        return ModelSource(spec, kind, objective, config=_load_config(spec, path))
    if ":" in spec:
        return ModelSource(spec, "factory", objective, factory=_import_factory(spec))
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        raise WorkflowError(f"`model` {spec}: no such file or directory; {_WHAT_WORKS}")
    if _offline():
        raise WorkflowError(
            f"`model` {spec}: not a local path, a module:factory or a built-in, and as a Hugging Face hub "
            f"name it cannot be fetched with HF_HUB_OFFLINE=1; {_WHAT_WORKS}"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as error:
        raise WorkflowError(
            f"`model` {spec}: cannot get its config from the Hugging Face hub ({first_line(error)}); "
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
            f"`model` {folder}: its run.json records no model and vocabulary size; give `model` the model "
            "itself (a built-in, a config or a module:factory)"
        )
    if (
        spec not in BUILTIN_MODELS
        and model_path(spec) is None
        and (spec.endswith(".json") or spec.startswith((".", "/", "~")) or ".py:" in spec)
    ):
        raise WorkflowError(
            f"`model` {folder}: the model its run.json records, {spec!r}, is not found from here (a path "
            "relative to where the run was started); run from that folder, or give `model` the model itself"
        )
    return spec, objective, vocab


def checkpoint_weights(path: Path) -> Path | None:
    """The weights file a checkpoint folder holds (the first of :data:`WEIGHT_FILES` there); None for a
    file or a folder without weights."""
    if not path.is_dir():
        return None
    return next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)


def settle_tokenizer(model: str, data: DataSettings, objective: str = "auto") -> DataSettings:
    """``data`` with the tokenizer a run on ``model`` uses: a checkpoint folder's own ``tokenizer.json``
    where no tokenizer file is given and ``data.train_tokenizer`` is off; else ``data`` as it is. Raises
    WorkflowError for a checkpoint without a tokenizer.json, asked for neither another nor a trained one, and
    for ``train_tokenizer`` beside a tokenizer file."""
    return resolve_workload(model, data, objective).data


def _settled(model: str, data: DataSettings, source: ModelSource | None) -> DataSettings:
    """``data`` with a checkpoint folder's own tokenizer (see :func:`settle_tokenizer`)."""
    if data.tokenizer is not None or data.train_tokenizer or source is None or source.kind != "checkpoint":
        return data
    if source.tokenizer_file is None:
        raise WorkflowError(
            f"`model` {model}: the checkpoint folder holds no tokenizer.json; give its tokenizer with "
            "`tokenizer` JSON, or `train_tokenizer` to train one on your text (the embedding and the "
            "output layer are then initialised anew)"
        )
    return dataclasses.replace(data, tokenizer=source.tokenizer_file, vocab_size=data.vocab_size)


@dataclass
class Workload:
    """A model, its tokenizer and its data, resolved once (:func:`resolve_workload`): what each training of
    a forecast, a localization, a band or a calibration takes, so that the model is found, the tokenizer
    settled, the corpus read and hashed, and the token blocks made once for all of them.

    ``model``: the spec as given (run.json records it); ``source``: what it resolved to (None where it did
    not resolve: the first run then reports the problem as it builds the model); ``data``: the settings with
    the tokenizer settled; ``objective``: as asked (``auto``, ``mlm`` or ``clm``)."""

    model: str
    source: ModelSource | None
    data: DataSettings
    objective: str
    _prepared: RunData | None = field(default=None, repr=False)
    _digest: str | None = field(default=None, repr=False)
    _built: tuple[Callable[[], nn.Module], str] | None = field(default=None, repr=False)

    def prepared(self) -> RunData:
        """The split documents, the tokenizer and the token blocks (:func:`prepare_data`), made once."""
        if self._prepared is None:
            self._prepared = prepare_data(self.data)
        return self._prepared

    def digest(self) -> str:
        """The corpus's hash (:func:`corpus_digest`), read once."""
        if self._digest is None:
            self._digest = corpus_digest(self.data)
        return self._digest

    def build(self) -> tuple[Callable[[], nn.Module], str]:
        """:meth:`ModelSource.build` for the workload's tokenizer and block length, once (a checkpoint's
        weights are read once): the model factory and the objective resolved."""
        if self._built is None:
            source = self.source if self.source is not None else resolve_model(self.model, self.objective)
            tokenizer = self.prepared().tokenizer
            replace = self.data.train_tokenizer
            self._built = source.build(tokenizer, self.data.seq_len, replace_vocabulary=replace)
        return self._built


def resolve_workload(
    model: str | Workload, data: DataSettings | None = None, objective: str = "auto"
) -> Workload:
    """``model`` (a ``--model`` spec) with ``data`` and ``objective`` resolved once into a
    :class:`Workload`; a Workload is returned as it is (``data`` then None or its own data)."""
    if isinstance(model, Workload):
        if data is not None and data != model.data:
            raise WorkflowError("a Workload carries its own data: pass `data` None with it")
        return model
    if data is None:
        raise WorkflowError("`data` is needed with a model spec (a DataSettings)")
    if data.train_tokenizer and data.tokenizer is not None:
        raise WorkflowError(
            "`train_tokenizer` trains a vocabulary on your text and `tokenizer` gives one: choose one"
        )
    try:
        source = resolve_model(model, objective)
    except WorkflowError:
        source = None  # the first run reports the model's problem itself, where it builds it
    return Workload(model, source, _settled(model, data, source), objective)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _load_config(spec: str, path: Path) -> Any:
    from transformers import AutoConfig

    if path.is_dir() and not (path / "config.json").is_file():
        raise WorkflowError(f"`model` {spec}: the directory holds no config.json; {_WHAT_WORKS}")
    if path.is_file() and path.suffix != ".json":
        raise WorkflowError(
            f"`model` {spec}: a model file must be a transformers config .json; {_WHAT_WORKS}"
        )
    try:
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise WorkflowError(
            f"`model` {spec}: not a usable transformers config ({first_line(error)})"
        ) from error


def _import_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise WorkflowError(f"`model` {spec}: expected 'module:factory'; {_WHAT_WORKS}")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            if not file.is_file():
                raise WorkflowError(f"`model` {spec}: no such Python file {module_name!r}")
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
            f"`model` {spec}: cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from error
    factory = getattr(module, attribute, None)
    if factory is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise WorkflowError(
            f"`model` {spec}: module {module_name!r} has no attribute {attribute!r}; its callables: "
            f"{', '.join(public) or '(none)'}"
        )
    if not callable(factory):
        raise WorkflowError(f"`model` {spec}: {attribute!r} is a {type(factory).__name__}, not a callable")
    return factory


def _config_factory(
    spec: str, config: Any, objective: str, tokenizer: TokenizerInfo, seq_len: int
) -> tuple[Callable[[], nn.Module], str]:
    auto, objective, masked = _head(spec, config, objective)
    config = copy.deepcopy(config)
    _check_positions(spec, config, seq_len)
    given = getattr(config, "vocab_size", None)
    if isinstance(given, int) and given != tokenizer.vocab_size and spec not in BUILTIN_MODELS:
        warnings.warn(
            f"`model` {spec}: its vocab_size {given} is replaced by the tokenizer's {tokenizer.vocab_size} "
            "(`vocab_size` or `tokenizer` decide it; the embedding and the output layer are sized to it)",
            UserWarning,
            stacklevel=2,
        )
    config.vocab_size = tokenizer.vocab_size
    config.pad_token_id = tokenizer.pad_id
    if objective == "clm":
        config.bos_token_id, config.eos_token_id = tokenizer.cls_id, tokenizer.sep_id
        if masked:  # an encoder (e.g. BERT) as a causal LM
            config.is_decoder = True

    def make() -> nn.Module:
        return auto.from_config(config)

    return make, objective


def _head(spec: str, config: Any, objective: str) -> tuple[Any, str, bool]:
    """The transformers auto class of the objective's head for ``config``, the objective resolved, and
    whether the model type has a masked-LM head (an encoder, made a decoder for the causal LM)."""
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
            f"`model` {spec}: transformers has no {objective or 'language-model'} head for model type "
            f"{model_type!r}; objectives it supports: {', '.join(heads) or 'none'}"
        )
    return (AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM), objective, masked


def _check_positions(spec: str, config: Any, seq_len: int) -> None:
    for name in ("max_position_embeddings", "n_positions"):
        positions = getattr(config, name, None)
        if isinstance(positions, int) and positions < seq_len:
            raise WorkflowError(
                f"`model` {spec}: {name}={positions} is shorter than `seq_len` {seq_len}; "
                f"use `seq_len` {positions} or less"
            )


def _checkpoint_factory(
    spec: str,
    config: Any,
    objective: str,
    tokenizer: TokenizerInfo,
    seq_len: int,
    replace_vocabulary: bool,
    weights: bool,
) -> tuple[Callable[[], nn.Module], str]:
    """Models that start from a checkpoint folder's weights (see the module docstring)."""
    auto, objective, masked = _head(spec, config, objective)
    _check_positions(spec, config, seq_len)
    config = copy.deepcopy(config)
    rows = getattr(config, "vocab_size", None)
    if replace_vocabulary:
        config.vocab_size, config.pad_token_id = tokenizer.vocab_size, tokenizer.pad_id
    elif isinstance(rows, int) and tokenizer.vocab_size > rows:
        raise WorkflowError(
            f"`model` {spec}: the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint embeds "
            f"{rows}; use the checkpoint's own tokenizer (its folder's tokenizer.json, the default), or "
            "`train_tokenizer` to train one (the embedding and the output layer are then initialised anew)"
        )
    if objective == "clm" and masked:  # an encoder (e.g. BERT) as a causal LM
        config.is_decoder = True
    if not weights:
        return (lambda: auto.from_config(config)), objective
    state, note = _read_checkpoint(spec, config, auto, replace_vocabulary)
    warnings.warn(note, UserWarning, stacklevel=3)

    def make() -> nn.Module:
        model = auto.from_config(config)  # what the checkpoint lacks: initialised from the global RNG
        model.load_state_dict(state, strict=False)
        return model

    return make, objective


def _read_checkpoint(
    spec: str, config: Any, auto: Any, replace_vocabulary: bool
) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors a checkpoint folder gives the model (Hugging Face's own loading: its key renames,
    sharded files, safetensors or pickles), and a one-line note of what was loaded and what was not."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        loaded, info = auto.from_pretrained(
            spec,
            config=config,
            output_loading_info=True,
            ignore_mismatched_sizes=replace_vocabulary,
            dtype=torch.float32,
        )
    except ImportError:
        raise
    except Exception as error:  # the user's file: safetensors, pickle and transformers each raise their own
        raise WorkflowError(f"`model` {spec}: cannot read its weights ({first_line(error)})") from error
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    absent = set(info.get("missing_keys") or ()) | {
        item[0] if isinstance(item, tuple | list) else item for item in info.get("mismatched_keys") or ()
    }
    state = {k: v.detach().clone() for k, v in loaded.state_dict().items() if k not in absent}
    parameters = sum(p.numel() for p in loaded.parameters())
    file = checkpoint_weights(Path(spec))
    count = f"{parameters / 1e6:.1f}M" if parameters >= 100_000 else f"{parameters:,}"
    note = (
        f"`model` {spec}: {len(state)} tensors loaded from {file.name if file else 'the checkpoint'} "
        f"({type(loaded).__name__}, {count} parameters)"
    )
    if absent:
        groups = sorted({key.split(".")[0] + ".*" for key in absent})
        shown = ", ".join(groups[:4]) + (", …" if len(groups) > 4 else "")
        why = "a new vocabulary, or " if replace_vocabulary else ""
        note += f"; {len(absent)} initialised from the run's seed ({shown}: {why}not in the checkpoint)"
    if replace_vocabulary:
        note += f"; its vocabulary replaced by the {config.vocab_size} tokens trained on your text"
    unused = info.get("unexpected_keys") or ()
    if unused:
        note += f"; {len(unused)} checkpoint tensors unused (e.g. {sorted(unused)[0]})"
    del loaded
    return state, note


def _module_objective(spec: str, model: nn.Module) -> str:
    """mlm or clm from the class or a base class: ``…ForMaskedLM``; ``…ForCausalLM``, ``…LMHeadModel``."""
    for cls in type(model).__mro__:
        if cls.__name__.endswith("ForMaskedLM"):
            return "mlm"
        if cls.__name__.endswith(("ForCausalLM", "LMHeadModel")):
            return "clm"
    raise WorkflowError(
        f"`model` {spec}: cannot tell whether a {type(model).__name__} is a masked or a causal LM; pass "
        "`objective` mlm or `objective` clm"
    )


def _check_embeddings(spec: str, model: nn.Module, tokenizer: TokenizerInfo) -> None:
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    rows = getattr(embedding, "num_embeddings", None)
    if isinstance(rows, int) and rows < tokenizer.vocab_size:
        raise WorkflowError(
            f"`model` {spec}: the model embeds {rows} token ids but the tokenizer trained on your text has "
            f"{tokenizer.vocab_size}; let the factory take a vocab_size argument, or pass `vocab_size` {rows}"
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
            f"`model` {spec}: model(input_ids=…, attention_mask=…, labels=…) failed with "
            f"{type(error).__name__}: {first_line(error)}; numscope trains transformers-style "
            "language models"
        ) from error
    for name in ("loss", "logits"):
        value = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
        if not isinstance(value, torch.Tensor):
            raise WorkflowError(
                f"`model` {spec}: the model's output has no {name!r} tensor; numscope trains "
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
    WordPiece vocabulary trained on the text; ``vocab_size`` is then the file's. Its special tokens are those
    its folder's ``special_tokens_map.json`` names, else found by BERT's, RoBERTa's or GPT's names
    (:meth:`numscope.run.tokenizer.TokenizerInfo.from_tokenizer`). None: a checkpoint folder's own
    ``tokenizer.json`` (:func:`settle_tokenizer`), else one trained on the text."""
    train_tokenizer: bool = False
    """Train a WordPiece vocabulary on the text even for a checkpoint folder that has its own tokenizer (its
    embedding and output layer are then initialised anew)."""

    def __post_init__(self) -> None:
        if isinstance(self.text, str | os.PathLike):
            object.__setattr__(self, "text", (str(self.text),))
        object.__setattr__(self, "text", tuple(str(p) for p in self.text))
        if not self.text:
            raise WorkflowError("no text files given; pass one or more UTF-8 text files (`text` PATH...)")
        for path in self.text:
            if not Path(path).is_file():
                what = "is a directory, not a file" if Path(path).is_dir() else "no such file"
                raise WorkflowError(f"`text` {path}: {what}")
        check_settings(self)
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", str(self.tokenizer))
            object.__setattr__(self, "vocab_size", _tokenizer_info(self.tokenizer).vocab_size)


def _tokenizer_info(path: str) -> TokenizerInfo:
    """The special-token ids and size of the tokenizer file ``path``, or a clear error."""
    from numscope.run.tokenizer import load_tokenizer_file

    if not Path(path).is_file():
        raise WorkflowError(
            f"`tokenizer` {path}: no such file (a tokenizers JSON, e.g. a model's tokenizer.json)"
        )
    try:
        _, info = load_tokenizer_file(path)
    except ValueError as error:
        raise WorkflowError(f"`tokenizer` {path}: {error}") from error
    except Exception as error:  # tokenizers raises its own Exception type for a malformed file
        raise WorkflowError(
            f"`tokenizer` {path}: not a tokenizers JSON file ({first_line(error)})"
        ) from error
    return info


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
    """Each setting within what it allows, and the batch within what the data and processes allow; a
    :class:`SettingsError` names the setting as the API does (the CLI prints its flag)."""
    check_settings(config)
    if config.mask_probability > 1:
        problem = f"must be in (0, 1]; got {config.mask_probability}"
        raise SettingsError("TrainConfig.mask_probability", problem)
    world = distributed.world_size()
    if config.batch_size % world:
        raise SettingsError(
            "TrainConfig.batch_size",
            f"{config.batch_size} (the global batch) does not divide over {world} processes",
        )
    blocks = data.train_blocks.shape[0]
    if blocks < config.batch_size:
        raise SettingsError(
            "TrainConfig.batch_size",
            f"{config.batch_size} exceeds the {blocks} training blocks your text makes at "
            f"DataSettings.seq_len {data.train_blocks.shape[1]}; give more text or a smaller "
            "TrainConfig.batch_size",
        )
