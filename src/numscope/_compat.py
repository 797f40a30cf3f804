"""What differs between the torch releases numscope supports (2.11 and later), in one place.

numscope uses a few private torch APIs (listed in pyproject.toml); where a release changed one, or changed
a public behaviour numscope relies on, the difference is handled here and nowhere else, and the test suite
runs on the oldest supported release (torch 2.11) as on the newest tested one.

* FP8 casts: from torch 2.12 on, an eager ``x.to(torch.float8_e4m3fn)`` saturates a finite value beyond
  ±448 (and ±inf) to ±448; torch 2.11 gives NaN there. numscope clamps before a saturating cast and sets
  NaN explicitly for ``overflow="propagate"``, so its casts are the same on both.
* Compiled round trips: torch 2.11's inductor drops ``x.to(torch.bfloat16).float()`` on the CPU even with
  ``emulate_precision_casts`` (the value comes back unrounded); torch 2.13's keeps it. Before 2.13 the
  compiled kernels round to bf16 and fp16 by the eager path's exact grid arithmetic instead (the same
  bits; :data:`COMPILED_ROUND_TRIPS`). 2.12 is untested here and takes the grid arithmetic.
"""

from __future__ import annotations

import re

import torch

#: the oldest torch release numscope supports
OLDEST = (2, 11)


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the running torch's, e.g. ``2.11.0+cu130`` → (2, 11))."""
    found = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if found is None:
        raise ValueError(f"not a torch version: {version or torch.__version__!r}")
    return int(found.group(1)), int(found.group(2))


#: whether inductor keeps a compiled ``x.to(bfloat16).float()`` as a rounding (see the module docstring)
COMPILED_ROUND_TRIPS = torch_release() >= (2, 13)
