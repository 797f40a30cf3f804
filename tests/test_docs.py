"""The documentation reads as a reference: the reference pages state what is true now (no date, no history
phrase), every measurement with a date lives on a results page that says when it was measured, there is a
concepts page and a page per task with an example and what it prints, every page is in the site's
navigation, and the README stays a front door (at most 150 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REFERENCE = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
RESULTS = sorted((DOCS / "results").glob("*.md"))

DATE = re.compile(
    r"\b20\d\d-\d\d(-\d\d)?\b|\b(January|February|March|April|May|June|July|August|September|October|November"
    r"|December) 20\d\d\b"
)
HISTORY = re.compile(
    r"earlier versions?|what changed|this session|(first|second|third|fourth|fifth|last|previous|another) "
    r"session|before (this|that|these) change|\bpreviously\b|\bused to\b|\bno longer\b|\bas before\b|"
    r"\buntil now\b|\b(was|were) changed\b|changed since|since the last|as measured before|the measurement "
    r"before|this version|\bissue \d+",
    re.IGNORECASE,
)
TASKS = ["forecast.md", "diagnose.md", "workflow.md", "python.md"]


def test_the_patterns_catch_what_they_are_for() -> None:
    assert DATE.search("a run of 2026-12-07") and DATE.search("in December 2026") and not DATE.search("v2.13")
    for phrase in ("Earlier versions printed", "What changed since", "(third session)", "issue 46 asks"):
        assert HISTORY.search(phrase), phrase
    assert not HISTORY.search("the previous step's amax") and not HISTORY.search("the first seed")


@pytest.mark.parametrize("page", REFERENCE, ids=lambda p: p.name)
def test_a_reference_page_holds_no_date_and_no_history(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    found = [
        f"{page.name}:{n}: {line.strip()[:120]}"
        for n, line in enumerate(text.splitlines(), 1)
        if DATE.search(line) or HISTORY.search(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("page", [p for p in RESULTS if p.name != "index.md"], ids=lambda p: p.name)
def test_a_results_page_says_when_it_was_measured(page: Path) -> None:
    second = page.read_text(encoding="utf-8").split("\n\n", 2)[1]
    assert second.startswith("*Measured ") and DATE.search(second), second[:200]
    assert page.name in (DOCS / "results" / "index.md").read_text(encoding="utf-8")


def test_a_concepts_page_and_a_page_per_task_each_with_an_example_and_its_output() -> None:
    concepts = (DOCS / "concepts.md").read_text(encoding="utf-8")
    for term in ("## Formats", "## Scaling", "## The three GEMMs of a layer", "## Plans and recipes"):
        assert term in concepts
    assert "## Gap and seed noise" in concepts
    for name in TASKS:
        text = (DOCS / name).read_text(encoding="utf-8")
        assert "## Example" in text or "```bash\nnumscope " in text, name
        assert re.search(r"(It )?prints[^\n]*:\n\n```\n", text), f"{name} shows no output"


def test_every_page_is_in_the_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("plugins:")[0])

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        return []

    listed = set(pages(config["nav"]))
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk <= listed, sorted(on_disk - listed)


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, len(lines)
