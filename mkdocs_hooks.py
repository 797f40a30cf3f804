"""MkDocs hook: the site's home page is the README (the repository's front door), its links to ``docs/X``
made relative to the site, so that the README is written once and read in both places."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    readme = Path(config["config_file_path"]).parent / "README.md"
    text = readme.read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=text))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The docs pages link to ``../README.md`` (``../../README.md`` from ``results/``; right on the
    repository's file view): on the site that is the home page."""
    return markdown.replace("](../../README.md", "](../index.md").replace("](../README.md", "](index.md")
