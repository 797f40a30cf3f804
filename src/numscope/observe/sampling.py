"""The observer's working records: rows along the contraction axis, operands waiting for their GEMM partner,
measurements shared within a step, and the helpers that draw and identify them."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from numscope.formats.blocks import tile_shape
from numscope.formats.scaling import Scaling, reduce_amax_
from numscope.formats.spec import Format
from numscope.metrics.stats import Log2Histogram
from numscope.observe.config import BATCH_ENTRIES, MIN_ROWS


@dataclass
class _Rows:
    """Whole rows of an operand along its contraction axis, (entries, rows, K) float32 (:func:`draw_rows`)."""

    values: torch.Tensor
    be_entries: torch.Tensor | None  # which entries of ``values`` enter the backward error (None: all)
    be_rows: torch.Tensor  # which rows of each entry enter the backward error
    batch: torch.Tensor | None  # the batch entries drawn for the backward error (shared with the partner)
    batch_shape: tuple[int, ...]

    def for_be(self, values: torch.Tensor) -> torch.Tensor:
        """The backward error's rows of ``values`` (shaped as :attr:`values`)."""
        if self.be_entries is not None:
            values = values[self.be_entries]
        return values[:, self.be_rows]


@dataclass
class _Half:
    """One operand of a GEMM waiting for its partner: rows (contraction last) and their quantizations."""

    rows: torch.Tensor  # (batch, rows, K) float32
    quantized: dict[str, torch.Tensor]  # candidate -> the rows as they are inside the quantized tensor
    batch: torch.Tensor | None  # the batch entries drawn (shared with the partner), None when not batched
    batch_shape: tuple[int, ...]


@dataclass
class _ConvHalf:
    """One operand of a convolution's GEMM waiting for its partner, in the operand's own layout."""

    values: torch.Tensor  # float32; input and grad_output: the drawn batch entries only
    quantized: dict[str, torch.Tensor]  # candidate -> the values as they are inside the quantized tensor
    batch: torch.Tensor | None  # the batch entries drawn (shared with the partner); None for the weight


@dataclass
class _Shared:
    """What does not depend on the contraction axis, for reuse within a step (see ``_shared_measurement``).

    owner: a weak reference to the tensor measured: while it lives and still holds the memory it was measured
        in at the same version, that memory holds the same values (a live tensor can lose its memory:
        FSDP2 frees an unsharded parameter's storage after forward).
    """

    owner: Callable[[], torch.Tensor | None]
    local_amax: torch.Tensor  # this rank's max|·| of the whole tensor
    sample: torch.Tensor
    stats: dict[str, float]
    metrics: dict[str, dict[str, float]]
    histogram: Log2Histogram
    sampled: int
    index: torch.Tensor | None  # the sample's indices into the flattened tensor (None: the whole tensor)


def _absmax(tensor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max|·| over ``dims`` as float32, without a full-size |tensor| temporary."""
    return torch.maximum(tensor.amax(dim=dims).abs(), tensor.amin(dim=dims).abs()).float()


def _scaling_amax(tensor: torch.Tensor, index: torch.Tensor, fmt: Format, scaling: Scaling) -> torch.Tensor:
    """For the elements at ``index`` of the flattened ``tensor``, the amax of their row, column or tile (an
    element format's block scaling over the last two axes), as ``numscope.quantize`` derives the scales:
    computed by reductions that hold one value per row, column or tile."""
    matrix = tensor.reshape(1, -1) if tensor.dim() < 2 else tensor  # quantize treats a vector as one row
    rows, cols = matrix.shape[-2], matrix.shape[-1]
    if scaling.kind == "row":
        return _absmax(matrix, (-1,)).reshape(-1)[index // cols]
    if scaling.kind == "column":
        columns = _absmax(matrix, tuple(range(matrix.dim() - 1))).reshape(-1)
        if tensor.dim() >= 2:  # reduced across ranks as quantize reduces it (rows split over the ranks)
            columns = reduce_amax_(columns, scaling.reduce_amax)
        return columns[index % cols]
    assert scaling.kind == "block"
    rows_per, cols_per = tile_shape(tensor, fmt, scaling)
    whole = cols // cols_per * cols_per
    parts = []
    if whole:
        parts.append(_absmax(matrix[..., :whole].unflatten(-1, (whole // cols_per, cols_per)), (-1,)))
    if whole < cols:
        parts.append(_absmax(matrix[..., whole:], (-1,))[..., None])
    per_row_tile = torch.cat(parts, dim=-1)  # (..., rows, column tiles), ≥ 0: zero padding is neutral
    padded = F.pad(per_row_tile, (0, 0, 0, (-rows) % rows_per))
    tiles = padded.unflatten(-2, (-1, rows_per)).amax(dim=-2)
    tiles = tiles.reshape(-1, tiles.shape[-2], tiles.shape[-1])
    leading, within = index // (rows * cols), index % (rows * cols)
    return tiles[leading, within // cols // rows_per, within % cols // cols_per]


def draw(generator: torch.Generator, high: int, count: int) -> torch.Tensor:
    """``count`` indices drawn uniformly from ``range(high)`` (with replacement) from ``generator``."""
    return torch.randint(high, (count,), generator=generator, device=generator.device)


def draw_rows(
    tensor: torch.Tensor,
    axis: int,
    partner: _Half | None,
    max_elements: int,
    be_rows: int,
    generator: torch.Generator,
) -> _Rows:
    """Whole rows along the contraction axis: every row of a tensor of at most ``max_elements``
    elements, else ``max_elements // K`` uniformly drawn rows (at least one), within up to
    ``BATCH_ENTRIES`` batch entries (shared with the GEMM partner) for a batched operand; and which
    of them enter the backward error (``be_rows`` of them, uniformly). The draws come from ``generator``."""
    moved = tensor.movedim(axis, -1) if tensor.dim() else tensor.reshape(1)
    if moved.dim() == 1:
        moved = moved.reshape(1, -1)
    length = moved.shape[-1]
    batch_shape = tuple(moved.shape[:-2]) if moved.dim() >= 3 else ()
    batched = partner is not None and partner.batch is not None and partner.batch_shape == batch_shape
    whole = moved.numel() <= max_elements
    wanted = max(min(be_rows, MIN_ROWS), max_elements // max(length, 1))
    if batch_shape and (partner is None or batched):
        matrix = moved.reshape(-1, moved.shape[-2], length)
        if batched:
            batch = partner.batch
        else:
            count = min(BATCH_ENTRIES, matrix.shape[0])
            batch = draw(generator, matrix.shape[0], count).to(tensor.device)
        if whole:
            values = matrix.float()
        else:
            per_entry = max(1, wanted // len(batch))
            row_index = draw(generator, matrix.shape[1], per_entry).to(tensor.device)
            values = matrix[batch[:, None], row_index[None, :]].float()
        be_per_entry = max(1, be_rows // len(batch))
    else:
        matrix = moved.reshape(-1, length)
        if whole:
            values = matrix.float()[None]
        else:
            values = matrix[draw(generator, matrix.shape[0], wanted).to(tensor.device)].float()[None]
        batch = None
        be_per_entry = be_rows
    if whole:  # every row is here: draw the backward error's rows among them, without replacement
        order = torch.randperm(values.shape[1], generator=generator, device=generator.device)
        be_rows = order[:be_per_entry].to(tensor.device)
        be_entries = batch
    else:  # the rows were drawn at random: the first ones are a uniform draw too
        be_rows = torch.arange(min(be_per_entry, values.shape[1]), device=tensor.device)
        be_entries = None
    return _Rows(values, be_entries, be_rows, batch, batch_shape)


def _weak(tensor: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    try:
        return weakref.ref(tensor)
    except TypeError:
        return lambda: None


def _identity(tensor: torch.Tensor) -> tuple | None:
    """Where a tensor's values live: (device, address, count, dtype, version) for a tensor that covers its
    memory densely without overlap (a permutation of a contiguous layout), else None (never reused)."""
    try:
        address = tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if address == 0:
        return None
    layout = zip(tensor.stride(), tensor.shape, strict=True)
    dims = sorted((stride, size) for stride, size in layout if size > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return (tensor.device, address, tensor.numel(), tensor.dtype, tensor._version)
