"""Rotations applied to an operand before it is cast: the random Hadamard transform (RHT).

NVIDIA's NVFP4 training recipe (Transformer Engine ``NVFP4BlockScaling``) and the MXFP4 recipe of Tseng
et al. 2025 ("Training LLMs with MXFP4") rotate the operands of a GEMM, in blocks of ``size`` consecutive
elements along its contraction axis, by Q = D·H / √size (H the Sylvester Hadamard matrix, D a diagonal of
random signs), and quantize the rotated values: outliers spread over their block, and the product is
unchanged because Q is orthogonal (xQ · (yQ)ᵀ = x·yᵀ). numscope emulates this on each operand as
Qᵀ·quantize(Q·x): the rotated tensor is quantized, then rotated back, so that the GEMM of two operands
rotated alike equals that of their quantized rotations, up to float32 rounding of the two rotations
(relative 1e-7, far below any format's error here). Pure functions; the sign vector is drawn from a
``torch.Generator`` seeded with ``seed``, so it is the same in every process.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_RHT = re.compile(r"^rht(\d+)(?::(\d+|fresh))?$")


@dataclass(frozen=True)
class Rotation:
    """A random Hadamard transform: blocks of ``size`` (a power of two) and the seed of its signs.

    ``fresh`` (``rhtN:fresh``): new random signs for every GEMM call, shared by the GEMM's two operands, as
    the MXFP4 recipe's code draws them in each backward call; ``numscope.convert`` draws them (from its
    generator) and passes them as ``signs``. Where no GEMM call draws them (``quantize``, the observer's
    measurements), a fresh transform uses the seed-0 signs: the same distribution, one fixed draw.
    """

    size: int = 16
    seed: int = 0
    fresh: bool = False
    #: an explicit sign vector (±1, ``size`` long) that replaces the seeded one (a fresh transform's draw)
    signs: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size < 2 or self.size & (self.size - 1):
            raise ValueError(f"a Hadamard transform's size must be a power of two >= 2, got {self.size}")
        if self.seed < 0:
            raise ValueError(f"a Hadamard transform's seed must be >= 0, got {self.seed}")
        if self.signs is not None and (
            len(self.signs) != self.size or any(sign not in (1, -1) for sign in self.signs)
        ):
            raise ValueError(f"a Hadamard transform's signs are {self.size} values of +1 or -1")

    @classmethod
    def parse(cls, name: str) -> Rotation:
        """``rht16`` (blocks of 16, seed 0), ``rht32:7`` (blocks of 32, seed 7), ``rht64:fresh`` (blocks of
        64, new signs for every GEMM call)."""
        found = _RHT.match(name.strip().lower()) if isinstance(name, str) else None
        if found is None:
            raise ValueError(
                f"unknown transform {name!r}; allowed: 'rhtN', 'rhtN:SEED' or 'rhtN:fresh' (a random "
                "Hadamard transform of blocks of N, a power of two, e.g. 'rht16')"
            )
        if found.group(2) == "fresh":
            return cls(int(found.group(1)), fresh=True)
        return cls(int(found.group(1)), int(found.group(2) or 0))

    @property
    def name(self) -> str:
        if self.fresh:
            return f"rht{self.size}:fresh"
        return f"rht{self.size}" + (f":{self.seed}" if self.seed else "")

    def draw_signs(
        self, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """A new sign vector (±1, int64) on ``device`` (None: the CPU), from ``generator`` (None: the
        default generator of ``device``). A generator on another device draws there and the signs are
        moved: the same signs as that generator gives anywhere."""
        where = generator.device if generator is not None else device
        signs = torch.randint(0, 2, (self.size,), generator=generator, device=where) * 2 - 1
        return signs if device is None else signs.to(device)

    def matrix(self, device: torch.device | None = None, signs: torch.Tensor | None = None) -> torch.Tensor:
        """Q = D·H / √size, float32 (orthogonal), on ``device``; ``signs`` (a tensor of ±1): this call's
        draw, in place of the transform's own signs. Built on ``device`` from a cached H / √size: a sign
        flips a float32 value exactly, so every device holds the same Q."""
        device = torch.device("cpu") if device is None else torch.device(device)
        if signs is not None:
            vector = signs.to(device=device, dtype=torch.float32)
            return vector.unsqueeze(1) * _scaled_hadamard(self.size, device)
        own = self.signs if self.signs is not None else _seeded_signs(self.size, self.seed)
        return _signed_matrix(own, device)

    def rotate(
        self, x: torch.Tensor, axis: int = -1, inverse: bool = False, signs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` rotated by Q (or Qᵀ) in blocks along ``axis``, which must be a multiple of ``size`` long;
        ``signs``: this call's draw (see :meth:`matrix`)."""
        if x.shape[axis] % self.size:
            raise ValueError(
                f"a Hadamard transform of blocks of {self.size} needs a length divisible by {self.size} "
                f"along axis {axis}, got shape {tuple(x.shape)}"
            )
        moved = x.float().movedim(axis, -1)
        q = self.matrix(x.device, signs)
        blocks = moved.reshape(*moved.shape[:-1], -1, self.size)
        rotated = blocks @ (q.t() if inverse else q)
        return rotated.reshape(moved.shape).movedim(-1, axis)

    def quantized(
        self,
        x: torch.Tensor,
        axis: int,
        quantize: Callable[[torch.Tensor, int], torch.Tensor],
        signs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Qᵀ·quantize(Q·x) along ``axis`` (float32): ``quantize(rotated, axis)`` gets the rotated tensor,
        zero-padded to whole blocks along ``axis``; the padding is dropped after the rotation back.
        ``signs``: this call's draw (a fresh transform's), in place of the transform's own."""
        axis = axis % max(x.dim(), 1)
        length = x.shape[axis] if x.dim() else 1
        moved = x.float().reshape(1) if x.dim() == 0 else x.float().movedim(axis, -1)
        pad = (-length) % self.size
        padded = F.pad(moved, (0, pad)) if pad else moved
        rotated = self.rotate(padded, signs=signs)
        restored = self.rotate(quantize(rotated, -1), inverse=True, signs=signs).narrow(-1, 0, length)
        return restored.reshape(x.shape) if x.dim() == 0 else restored.movedim(-1, axis)


def _hadamard(size: int, device: torch.device) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order ``size``, float64, built on ``device``."""
    hadamard = torch.ones(1, 1, dtype=torch.float64, device=device)
    while hadamard.shape[0] < size:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    return hadamard


@functools.cache
def _seeded_signs(size: int, seed: int) -> tuple[int, ...]:
    """The sign vector of a seeded transform (CPU generator: the same in every process and device)."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (size,), generator=generator, dtype=torch.float64) * 2 - 1
    return tuple(int(sign) for sign in signs.tolist())


@functools.lru_cache(maxsize=64)
def _signed_matrix(signs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """D·H / √size for a fixed sign vector, kept on ``device`` (built once, not per GEMM call)."""
    vector = torch.tensor(signs, dtype=torch.float32, device=device)
    return vector.unsqueeze(1) * _scaled_hadamard(len(signs), device)


@functools.lru_cache(maxsize=64)
def _scaled_hadamard(size: int, device: torch.device) -> torch.Tensor:
    """H / √size rounded once to float32 (from float64), kept on ``device``."""
    return (_hadamard(size, device) / math.sqrt(size)).float()
