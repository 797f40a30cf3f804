"""Bit-exact comparison of float32 results, shared by the format tests (NaN matches NaN, -0 is not +0)."""

from __future__ import annotations

import numpy as np
import torch


def _array(values: np.ndarray | torch.Tensor, float32: bool = True) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.ascontiguousarray(values)
    assert not float32 or array.dtype == np.float32, f"expected float32 values, got {array.dtype}"
    return array


def mismatches(actual: np.ndarray | torch.Tensor, expected: np.ndarray | torch.Tensor) -> np.ndarray:
    """The flat indices where the float32 bit patterns of ``actual`` and ``expected`` differ (any NaN
    matches any NaN)."""
    a, e = _array(actual), _array(expected)
    assert a.shape == e.shape, f"shapes differ: {a.shape} vs {e.shape}"
    same = (a.view(np.uint32) == e.view(np.uint32)) | (np.isnan(a) & np.isnan(e))
    return np.flatnonzero(~same)


def assert_bits_equal(
    actual: np.ndarray | torch.Tensor,
    expected: np.ndarray | torch.Tensor,
    inputs: np.ndarray | torch.Tensor | None = None,
) -> None:
    """``actual`` equals ``expected`` bit for bit; the failure names the first differing values (and, with
    ``inputs``, the inputs they came from)."""
    bad = mismatches(actual, expected)
    if bad.size == 0:
        return
    a, e = _array(actual).ravel(), _array(expected).ravel()
    where = ""
    if inputs is not None:
        where = f"inputs {_array(inputs, float32=False).ravel()[bad[:5]].tolist()} -> "
    raise AssertionError(
        f"{bad.size} of {a.size} differ; first {where}{a[bad[:5]].tolist()}, expected {e[bad[:5]].tolist()}"
    )
