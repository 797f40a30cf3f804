"""Shared fixtures of the demo tests: the real corpus, and a small tokenizer trained on a slice of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from numscope.demo.corpus import load_corpus, split_corpus
from numscope.demo.tokenizer import TokenizerInfo, load_or_train_tokenizer

SMALL_VOCAB = 1000


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return load_corpus()


@pytest.fixture(scope="session")
def small_train(corpus: list[str]) -> list[str]:
    train, _ = split_corpus(corpus)
    return train[:300]


@pytest.fixture(scope="session")
def small_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("numscope-cache")


@pytest.fixture(scope="session")
def small_vocab_size() -> int:
    return SMALL_VOCAB


@pytest.fixture(scope="session")
def small_tokenizer(small_train: list[str], small_cache: Path) -> Tokenizer:
    return load_or_train_tokenizer(small_train, SMALL_VOCAB, cache_dir=small_cache)


@pytest.fixture(scope="session")
def small_info(small_tokenizer: Tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_tokenizer(small_tokenizer)
