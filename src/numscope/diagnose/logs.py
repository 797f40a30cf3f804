"""Loss logs of a user's own runs: a CSV of step and loss, or TensorBoard event files
(:func:`read_loss_log`).

The event files are read without TensorBoard: a TFRecord stream (length, its CRC, the record, its CRC) of
``Event`` protocol buffers, of which only ``step`` and each summary value's ``tag`` and number are needed
(``simple_value``, or a scalar ``tensor`` as TensorFlow 2 writes it). The tests check the reader against
files that ``torch.utils.tensorboard`` writes.
"""

from __future__ import annotations

import csv
import os
import struct
from pathlib import Path

from numscope.errors import NumscopeError

#: the loss column or tag names tried, in order, when none is given
LOSS_NAMES = ("loss", "train_loss", "train/loss", "lm loss", "lm_loss", "Loss/train", "training_loss")
STEP_NAMES = ("step", "global_step", "iteration", "iter")


class LogError(NumscopeError, ValueError):
    """A loss log that cannot be read: no such file, no step or loss column or tag, no rows."""


def read_loss_log(path: str | os.PathLike[str], key: str | None = None) -> dict[int, float]:
    """Step → loss from a CSV file (a ``step`` column and a loss column: ``key``, else the first of
    :data:`LOSS_NAMES` present) or TensorBoard event files (a file ``events.out.tfevents.*``, or a folder
    holding some: the scalar tagged ``key``, else the first of :data:`LOSS_NAMES`). A step logged twice
    keeps its last value; non-finite losses are kept (they are part of what went wrong)."""
    p = Path(path)
    if p.is_dir():
        events = sorted(p.rglob("events.out.tfevents.*"))
        if not events:
            raise LogError(f"{p}: a folder without TensorBoard event files (events.out.tfevents.*)")
        return _events(events, key, str(p))
    if not p.is_file():
        raise LogError(f"{p}: no such loss log (a CSV of step and loss, or TensorBoard event files)")
    if p.name.startswith("events.out.tfevents"):
        return _events([p], key, str(p))
    return _csv(p, key)


def _csv(path: Path, key: str | None) -> dict[int, float]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            step = next((c for c in STEP_NAMES if c in columns), None)
            loss = key if key is not None else next((c for c in LOSS_NAMES if c in columns), None)
            if step is None or loss not in columns:
                raise LogError(
                    f"{path}: needs a step column ({', '.join(STEP_NAMES)}) and a loss column ("
                    + (repr(key) if key is not None else ", ".join(LOSS_NAMES))
                    + f"); it has {', '.join(columns) or 'no header'}"
                )
            out = {}
            for row in reader:
                if not row.get(step) or not row.get(loss):
                    continue  # a row of another kind (a validation row without a training loss)
                out[int(float(row[step]))] = float(row[loss])
    except (UnicodeDecodeError, ValueError) as error:
        if isinstance(error, LogError):
            raise
        raise LogError(f"{path}: not a CSV loss log ({type(error).__name__}: {error})") from error
    if not out:
        raise LogError(f"{path}: no rows with both a step and a loss")
    return out


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int, object]]:
    """The (field number, wire type, value) of one protobuf message: varints as ints, fixed64/fixed32 as
    raw bytes, length-delimited as bytes."""
    out, at = [], 0
    while at < len(data):
        tag, at = _varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = data[at : at + 8], at + 8
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at : at + length], at + length
        elif wire == 5:
            value, at = data[at : at + 4], at + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not read here")
        out.append((number, wire, value))
    return out


def _scalar(value: bytes) -> tuple[str, float | None]:
    """A ``Summary.Value``'s tag and number (``simple_value`` = 2, or ``tensor`` = 8 holding one float)."""
    tag, number = "", None
    for field_number, wire, content in _fields(value):
        if field_number == 1 and wire == 2:
            tag = bytes(content).decode("utf-8", "replace")  # type: ignore[arg-type]
        elif field_number == 2 and wire == 5:
            number = struct.unpack("<f", content)[0]  # type: ignore[arg-type]
        elif field_number == 8 and wire == 2:  # TensorProto: dtype 1, float_val 5, double_val 6
            for tf_field, tf_wire, tf_value in _fields(content):  # type: ignore[arg-type]
                if tf_field == 5 and tf_wire == 5:
                    number = struct.unpack("<f", tf_value)[0]  # type: ignore[arg-type]
                elif tf_field == 5 and tf_wire == 2 and len(tf_value) >= 4:  # type: ignore[arg-type]
                    number = struct.unpack("<f", tf_value[:4])[0]  # type: ignore[index]
                elif tf_field == 6 and tf_wire == 1:
                    number = struct.unpack("<d", tf_value)[0]  # type: ignore[arg-type]
                elif tf_field == 6 and tf_wire == 2 and len(tf_value) >= 8:  # type: ignore[arg-type]
                    number = struct.unpack("<d", tf_value[:8])[0]  # type: ignore[index]
    return tag, number


def _events(files: list[Path], key: str | None, where: str) -> dict[int, float]:
    by_tag: dict[str, dict[int, float]] = {}
    for path in files:
        data = path.read_bytes()
        at = 0
        try:
            while at + 12 <= len(data):
                (length,) = struct.unpack("<Q", data[at : at + 8])
                record = data[at + 12 : at + 12 + length]
                at += 12 + length + 4
                if len(record) < length:
                    break  # a file cut off while its writer ran: keep what came before
                step = 0
                values = []
                for number, wire, value in _fields(record):
                    if number == 2 and wire == 0:
                        step = value  # type: ignore[assignment]
                    elif number == 5 and wire == 2:
                        values += [v for n, w, v in _fields(value) if n == 1 and w == 2]  # type: ignore[arg-type]
                for value in values:
                    tag, number_ = _scalar(value)  # type: ignore[arg-type]
                    if number_ is not None:
                        by_tag.setdefault(tag, {})[int(step)] = float(number_)
        except (ValueError, IndexError, struct.error) as error:
            raise LogError(f"{path}: not a TensorBoard event file ({error})") from error
    if key is not None:
        if key not in by_tag:
            raise LogError(f"{where}: no scalar tagged {key!r}; tags: {', '.join(sorted(by_tag)) or 'none'}")
        return by_tag[key]
    tag = next((t for t in LOSS_NAMES if t in by_tag), None)
    if tag is None:
        raise LogError(
            f"{where}: no loss scalar among the tags ({', '.join(sorted(by_tag)) or 'none'}); name it with "
            f"the tag option (tried {', '.join(LOSS_NAMES)})"
        )
    return by_tag[tag]
