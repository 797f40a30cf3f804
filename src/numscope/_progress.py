"""Progress of a long stage: a bar on a terminal, a few plain lines in a log.

On a terminal numscope shows tqdm's bars. Written to a file or a pipe, a bar's redrawn frames would fill
the log (the demo wrote 10,860 of them, 660 KB); there each stage prints one line when it starts, one at
each tenth of its total, and one when it ends, with the bar's last figures (a loss, a count).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    enabled: bool = True,
    unit: str = "it",
) -> Any:
    """A progress bar with tqdm's interface (``n``, ``total``, ``update``, ``set_postfix``,
    ``set_postfix_str``, ``refresh``, ``close``, iteration, ``with``): tqdm's own on a terminal (stderr),
    else :class:`LogLines`; nothing shown where ``enabled`` is false."""
    from tqdm.auto import tqdm

    if not enabled or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, disable=not enabled, leave=True, unit=unit)
    return LogLines(iterable, total=total, desc=desc.strip())


class LogLines:
    """tqdm's interface as a few lines on stderr: at the start, at each tenth of ``total`` and at the end."""

    def __init__(
        self, iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = ""
    ) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.desc = desc
        self.n = 0
        self._postfix = ""
        self._began = time.perf_counter()
        self._tenths = 0
        self._closed = False
        self._say("started" + (f", {total}" if total else ""))

    def _say(self, what: str) -> None:
        postfix = f" ({self._postfix})" if self._postfix else ""
        print(f"{self.desc}: {what}{postfix}", file=sys.stderr, flush=True)

    def set_postfix(
        self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **values: Any
    ) -> None:
        items = {**(ordered_dict or {}), **values}
        self._postfix = ", ".join(f"{key}={value}" for key, value in items.items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self._postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def refresh(self) -> None:
        """A line where ``n`` has passed the next tenth of ``total`` (none without a total)."""
        if not self.total or self._closed:
            return
        tenths = min(10, self.n * 10 // self.total)
        if tenths > self._tenths and self.n < self.total:
            self._tenths = tenths
            self._say(f"{self.n}/{self.total}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        seconds = time.perf_counter() - self._began
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        self._say(f"done {count} in {seconds:.0f}s")

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "LogLines iterates only over the iterable it was given"
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
