"""numscope.train.allocator: glibc's mmap threshold fixed, so freed tensors leave the process."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from numscope.train import allocator

# glibc's own counters (mallinfo2: hblks, the chunks served by mmap) around a 1 MiB malloc, after one freed
# 8 MiB chunk has raised glibc's moving threshold past 1 MiB (unless the threshold is fixed).
_PROBE = """
import ctypes, json, sys
from numscope.train import allocator
fixed = allocator.return_freed_memory() if sys.argv[1] == "fix" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.free(libc.malloc(8 * 2**20))
before = libc.mallinfo2().hblks
block = libc.malloc(2**20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"fixed": fixed, "mapped": mapped, "after_free": libc.mallinfo2().hblks - before}))
"""


def _probe(mode: str) -> dict[str, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=environment, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(
    allocator._mallopt() is None or not _has_mallinfo2(), reason="needs glibc 2.33 or later (Linux)"
)
def test_a_freed_tensor_sized_block_leaves_the_process_once_the_threshold_is_fixed() -> None:
    kept, returned = _probe("keep"), _probe("fix")
    assert kept == {"fixed": False, "mapped": 0, "after_free": 0}  # glibc's moving threshold: the heap
    assert returned == {"fixed": True, "mapped": 1, "after_free": 0}  # mapped, and unmapped when freed


def test_threshold_must_be_a_size_glibc_accepts() -> None:
    for bad in (0, -1, 64 * 2**20, 1.5, True):
        with pytest.raises(ValueError, match="number of bytes"):
            allocator.return_freed_memory(bad)  # type: ignore[arg-type]


def test_the_users_environment_setting_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.return_freed_memory() is False
