"""The BERT masked-LM demo: corpus, tokenizer, model factory and data pipeline.

``corpus`` reads the default Wikipedia corpus (CC BY-SA 4.0) or the user's text files and splits them;
``tokenizer`` trains and caches a WordPiece tokenizer on the training split; ``model`` builds a small
``BertForMaskedLM`` from a config; ``data`` turns documents into masked batches and scores a model on a fixed
set of masked tokens. Names are resolved lazily so that reading the corpus does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "CORPUS_ATTRIBUTION": "numscope.demo.corpus",
    "CORPUS_INSTALL": "numscope.demo.corpus",
    "CorpusError": "numscope.demo.corpus",
    "CorpusNotFoundError": "numscope.demo.corpus",
    "corpus_hash": "numscope.demo.corpus",
    "default_corpus_path": "numscope.demo.corpus",
    "load_corpus": "numscope.demo.corpus",
    "split_corpus": "numscope.demo.corpus",
    "DEFAULT_VOCAB_SIZE": "numscope.demo.tokenizer",
    "SPECIAL_TOKENS": "numscope.demo.tokenizer",
    "TokenizerInfo": "numscope.demo.tokenizer",
    "default_cache_dir": "numscope.demo.tokenizer",
    "load_or_train_tokenizer": "numscope.demo.tokenizer",
    "train_tokenizer": "numscope.demo.tokenizer",
    "ModelConfig": "numscope.demo.model",
    "bert_mlm_from_config": "numscope.demo.model",
    "make_bert_mlm": "numscope.demo.model",
    "IGNORE_INDEX": "numscope.demo.data",
    "MLMEvaluation": "numscope.demo.data",
    "batches": "numscope.demo.data",
    "evaluate_mlm": "numscope.demo.data",
    "load_or_make_blocks": "numscope.demo.data",
    "make_blocks": "numscope.demo.data",
    "mlm_mask": "numscope.demo.data",
    "num_batches": "numscope.demo.data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'numscope.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
