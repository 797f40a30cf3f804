"""Crash-safe file writes: every file numscope writes for the user goes through :func:`atomic_write`.

The content goes to a temporary file in the target's directory, is flushed and fsynced, and the temporary
is renamed over the target (atomic on POSIX) before the directory is fsynced: a crash leaves either the old
file or the new one, never a torn file, and no temporary is left behind when writing fails. The temporary is
created with ``os.open(..., 0o666)`` on a unique name (``O_EXCL``) rather than :func:`tempfile.mkstemp`,
whose mode 0600 the rename would hand to the target: the file gets the permissions a plain ``open()``
would give it under the user's umask.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Replace ``path`` atomically with what ``write`` writes to the binary file it is given; return the path.

    Either the previous file at ``path`` survives intact or the new one is complete; if ``write`` (or the
    rename) raises, the temporary file is removed and the exception propagates. The parent directory must
    exist.
    """
    target = Path(path)
    directory = target.parent
    temporary = directory / f".{target.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda file: file.write(data))


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """:func:`atomic_write` of ``text`` encoded as ``encoding``, written as is (no newline translation)."""
    return atomic_write_bytes(path, text.encode(encoding))


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable: fsync the directory entry (POSIX; Windows has no directory fsync)."""
    if os.name != "posix":
        return
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
