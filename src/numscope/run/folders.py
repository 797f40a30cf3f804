"""Run folders: where a run writes, what settings made the runs already in a folder, and whether a run in
it is finished. A rerun into a folder must use the folder's settings (that is what makes resuming sound);
every refusal names the folder, the settings that differ and what to do."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from numscope.run.config import RunError, RunResult, read_result


class OutputPathError(RunError):
    """An output folder or file that cannot be written (a file where a folder is asked, no write access…)."""


def check_output_folder(path: str | os.PathLike[str], flag: str = "`out`") -> Path:
    """``path`` as a folder that exists or can be made, and that this process can write into; else an
    :class:`OutputPathError` naming the path and the problem (before anything is trained or written)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{flag} {folder}: it is a file, not a folder; choose another {flag}")
    existing = folder if folder.exists() else next((p for p in folder.parents if p.exists()), Path("."))
    if not existing.is_dir():
        raise OutputPathError(f"{flag} {folder}: {existing} is a file, not a folder; choose another {flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {folder}: {existing} is not writable; choose another {flag}")
    _probe(folder, flag)
    return folder


def _probe(folder: Path, flag: str, shown: Path | None = None) -> None:
    """Make ``folder`` and a file in it, then remove what was made: permissions alone do not tell (root may
    write anywhere by them, yet not into /sys or /proc, nor onto a read-only mount)."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(dir=folder, prefix=".numscope-write-check-")
        os.close(descriptor)
        os.unlink(name)
    except OSError as error:
        where = "there" if shown is None else f"into {folder}"
        reason = error.strerror or error
        raise OutputPathError(
            f"{flag} {shown or folder}: cannot write {where} ({reason}); choose another {flag}"
        ) from error
    finally:
        for path in made:  # innermost first
            with contextlib.suppress(OSError):
                path.rmdir()


def check_output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a file to write: its folder must exist and be writable, and it must not be a folder."""
    target = Path(path)
    if target.is_dir():
        raise OutputPathError(f"{flag} {target}: it is a folder; give a file name")
    if not target.parent.is_dir():
        raise OutputPathError(f"{flag} {target}: no such folder {str(target.parent)!r}; create it first")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {target}: the folder {str(target.parent)!r} is not writable")
    _probe(target.parent, flag, target)  # root passes os.access everywhere, yet cannot write into /sys
    return target


def stored_run_name(out: Path) -> str | None:
    """The run name a folder's ``run.json`` recorded (so that a copied or moved folder resumes as itself)."""
    try:
        stored = json.loads((out / "run.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    name = stored.get("name") if isinstance(stored, dict) else None
    return name if isinstance(name, str) else None


def flat_settings(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as ``{"train.steps": 4, …}``, so that a difference names the one setting."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping) and value:
            flat.update(flat_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def short_value(value: Any) -> str:
    """A setting's value as JSON, cut to 60 characters."""
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


#: settings added after folders began to record theirs, with the value every earlier run had: a folder that
#: does not record one was made with that value (so that it still resumes)
ADDED_SETTINGS: dict[str, Any] = {"mask_probability": 0.15, "val_blocks": 256}


def setting_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``key: old → new`` for every setting that differs between two (nested) settings, keys sorted; a
    setting of :data:`ADDED_SETTINGS` that ``before`` lacks counts as its earlier value."""
    old, new = flat_settings(before), flat_settings(after)
    for key in set(new) - set(old):
        name = key.rsplit(".", 1)[-1]
        if name in ADDED_SETTINGS:
            old[key] = ADDED_SETTINGS[name]
    return [
        f"{key}: {short_value(old.get(key))} → {short_value(new.get(key))}"
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


def read_settings(path: Path) -> dict[str, Any] | None:
    """The settings a folder recorded in ``path`` (None if there is no such file); RunError if unreadable."""
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunError(
            f"{path}: unreadable ({error}); it records the settings of the runs in {path.parent}: choose "
            "another `out`, or delete the folder to start over"
        ) from error
    if not isinstance(stored, dict):
        raise RunError(f"{path}: not a run's settings (a JSON object); choose another `out`")
    return stored


def check_run_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse a rerun into ``out`` with settings other than its ``run.json`` records (RunError names them)."""
    stored = read_settings(out / "run.json")
    if stored is None:
        return
    ignore = {
        "numscope",
        "text",
        "command",
        "world_size",
        "device",
        "parallel",
        "objective_resolved",
        "model_path",
        "vocab_size_built",
        "tokenizer_path",
    }
    changed = setting_changes(
        {k: v for k, v in stored.items() if k not in ignore},
        {k: v for k, v in settings.items() if k not in ignore},
    )
    if changed:
        raise RunError(
            f"{out} already holds a run with other settings ({'; '.join(changed)}); rerun with the same "
            "flags to resume it, or choose another `out`"
        )


def finished_result(out: Path) -> RunResult | None:
    """The stored result of a finished run in ``out`` (its settings already checked), else None."""
    path = out / "result.json"
    return read_result(path) if path.is_file() else None
