"""Crash-safe checkpoints and the random state needed to resume training bit for bit.

:func:`save_checkpoint` writes to a temporary file in the target's directory, flushes and fsyncs it, renames
it over the target (atomic on POSIX) and fsyncs the directory: a crash leaves either the old checkpoint or
the new one, never a torn file. :func:`load_checkpoint` reads with ``torch.load(weights_only=True)``: a
checkpoint holds only tensors and plain containers (dicts, lists, tuples, numbers, strings, dtypes), so
loading never runs code from the file. :func:`rng_state` turns every random generator a training loop
draws from into such plain data.
"""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from numscope._atomic import atomic_write
from numscope.errors import NumscopeError

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

FORMAT_VERSION = 1
"""Version of the checkpoint layout, stored under the key ``"numscope_checkpoint"``."""

_VERSION_KEY = "numscope_checkpoint"


class CheckpointError(NumscopeError, ValueError):
    """A checkpoint file exists but cannot be used: corrupt, truncated, foreign or from a newer numscope."""


def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Write ``state`` (tensors and plain containers) to ``path`` atomically.

    Either the previous file at ``path`` survives intact or the new one is complete; no temporary file is
    left behind on failure. ``state`` is typically ``{"model": ..., "optimizer": ..., "scaler": ...,
    "master": ..., "rng": rng_state(), "step": n}``.
    """
    payload = {_VERSION_KEY: FORMAT_VERSION, "state": _plain(dict(state))}
    atomic_write(path, lambda file: torch.save(payload, file))


def _plain(value: Any) -> Any:
    """``value`` with every ``str`` subclass (numscope's vocabulary enums, as state keys) a plain ``str``, in
    dicts, lists and tuples at any depth, so that :func:`load_checkpoint` unpickles no class of numscope's. A
    container holding none is returned as it is (a ``state_dict()`` keeps its metadata)."""
    if isinstance(value, str):
        return value if type(value) is str else str.__str__(value)
    if isinstance(value, dict):
        items = [(_plain(k), _plain(v)) for k, v in value.items()]
        if all(a is k and b is v for (a, b), (k, v) in zip(items, value.items(), strict=True)):
            return value
        out = value.copy()
        out.clear()
        out.update(items)
        return out
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        children = [_plain(v) for v in value]
        if all(a is v for a, v in zip(children, value, strict=True)):
            return value
        return type(value)(children)
    return value


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` and return its ``state``.

    Raises ``FileNotFoundError`` naming ``path`` when there is no file, and :class:`CheckpointError` when the
    file is corrupt or truncated, holds objects other than tensors and plain containers, is not a numscope
    checkpoint, or was written by a newer format version than this numscope reads.
    """
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {str(source)!r}" + (" (it is a directory)" if source.is_dir() else "")
        )
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        rejected = [line.strip() for line in str(error).splitlines() if "Unsupported global" in line]
        if rejected:
            raise CheckpointError(
                f"checkpoint {str(source)!r} holds objects other than tensors and plain containers, which "
                f"numscope does not unpickle (weights_only=True); save state_dict()s instead. {rejected[0]}"
            ) from error
        raise _corrupt(source, error) from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as error:
        raise _corrupt(source, error) from error
    if not isinstance(payload, dict) or _VERSION_KEY not in payload or "state" not in payload:
        raise CheckpointError(
            f"{str(source)!r} is a torch file but not a numscope checkpoint (no {_VERSION_KEY!r} and "
            "'state' keys); "
            "write it with numscope.train.save_checkpoint"
        )
    version = payload[_VERSION_KEY]
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointError(
            f"checkpoint {str(source)!r} has format version {version!r}; this numscope reads versions 1 to "
            f"{FORMAT_VERSION}; upgrade numscope to load it"
        )
    return payload["state"]


def _corrupt(source: Path, error: BaseException) -> CheckpointError:
    size = source.stat().st_size
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    unsupported = [line for line in lines if "Unsupported" in line]
    detail = (unsupported or lines or ["(no message)"])[0]
    return CheckpointError(
        f"checkpoint {str(source)!r} ({size} bytes) is corrupt or truncated and cannot be read; it was "
        "probably written by an interrupted process that did not use save_checkpoint, or damaged on disk. "
        f"Resume from an earlier checkpoint or delete this file. Detail: {type(error).__name__}: {detail}"
    )


# ---------------------------------------------------------------------- random state
def rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Every random generator a training loop may draw from, as tensors and plain data.

    Captures Python's ``random``, NumPy's legacy global generator (``np.random.*``), torch's default CPU
    generator, every CUDA device's default generator when CUDA is available, and the ``generators`` given by
    name (e.g. the generator of a stochastic-rounding cast). Restore with :func:`set_rng_state`.
    """
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "generators": {name: generator.get_state() for name, generator in (generators or {}).items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Restore what :func:`rng_state` captured; ``generators`` must carry the same names as when captured."""
    saved_names, given_names = set(state["generators"]), set(generators or {})
    if saved_names != given_names:
        raise KeyError(
            f"rng state holds generators {sorted(saved_names)}, "
            f"but set_rng_state was given {sorted(given_names)}"
        )
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    for name, generator in (generators or {}).items():
        generator.set_state(state["generators"][name])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
