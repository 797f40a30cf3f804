"""Peak memory and glibc's allocator: give freed tensors back to the system.

glibc's ``malloc`` serves a large allocation by ``mmap`` and returns it to the system when it is freed, but
only above its *mmap threshold*, and that threshold moves: each time a mapped chunk is freed, glibc raises
the threshold to that chunk's size (up to 32 MiB on 64-bit systems). After a few freed float32 temporaries
(the casts and fp32 ops of a mixed-precision step make many), later tensors of their size come from the
heap, which keeps what is freed inside the process. The peak resident memory then follows what the heap
once held, not what is in use, and a recipe that keeps less for backward can still peak above fp32
(``benchmarks/bench_memory.py`` shows both columns).

:func:`return_freed_memory` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``, which also stops its
moving), as the ``MALLOC_MMAP_THRESHOLD_`` environment variable does when set before the process starts.
It is process-wide and lasts until the process ends; it changes no value any computation produces. It
costs time: every large tensor is then freshly mapped and its pages faulted in (on the training-step
benchmark about 13-17% per step, docs/results/benchmarks.md "Memory"), which is why only a
:class:`numscope.Recipe` that stores in fp16/bf16 turns it on by default.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (``<malloc.h>``)."""
DEFAULT_THRESHOLD = 128 * 1024
"""glibc's own starting threshold, 128 KiB: every tensor of 32 Ki float32 elements or more is mapped."""
_ENVIRONMENT = "MALLOC_MMAP_THRESHOLD_"

_applied: int | None = None


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl and others have no such symbol)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def return_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process, so that every freed allocation of
    that size or more leaves the process at once. Returns whether the threshold is now fixed: ``False`` off
    glibc, and when ``MALLOC_MMAP_THRESHOLD_`` is set in the environment (the user's choice stands; glibc
    has then fixed it already)."""
    global _applied
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 0 < threshold <= 32 * 2**20:
        raise ValueError(f"threshold must be a number of bytes in (0, 32 MiB]; got {threshold!r}")
    if _ENVIRONMENT in os.environ:
        return False
    if _applied == threshold:
        return True
    mallopt = _mallopt()
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return False
    _applied = threshold
    return True


def fixed_threshold() -> int | None:
    """The threshold :func:`return_freed_memory` fixed in this process, or ``None``."""
    return _applied
