"""Every bad input fails with a message that names the offending value and what is allowed."""

from __future__ import annotations

import re

import pytest
import torch

import numscope
from numscope import DelayedScaler, Scaling, get_format
from numscope.formats import set_fast

X = torch.ones(4, 8)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: get_format("fp8_e4m4"),
            ValueError,
            "unknown format 'fp8_e4m4'; did you mean 'fp8_e4m3'",
        ),
        (lambda: get_format("mxfp9"), ValueError, "known: bf16, e8m0, fp16"),
        (
            lambda: get_format("e9m2"),
            ValueError,
            "generic format 'e9m2': exponent bits must be 2..8",
        ),
        (lambda: get_format(8), TypeError, "a format is named by a string, got int: 8"),
        (lambda: get_format("fp8_e4m3@rceil"), ValueError, "apply only to the block formats"),
        (
            lambda: get_format("nvfp4@rceil"),
            ValueError,
            "format 'nvfp4': unknown option 'rceil'; the NVFP4 formats take: "
            "2d, row, 4over6, mae, divide, nan",
        ),
        (lambda: get_format("nvfp4@2d@row"), ValueError, "'2d' blocks and a per-row scale ('row')"),
        (
            lambda: get_format("mxfp8@rceil@even"),
            ValueError,
            "one scale rule at most, got even, rceil",
        ),
        (
            lambda: get_format("mxfp4@full"),
            ValueError,
            "option 'full' applies only to integer elements",
        ),
        (
            lambda: get_format("mxfp8@up"),
            ValueError,
            "format 'mxfp8_e4m3': unknown option 'up'; the MX formats take: rceil, ceil, even, full",
        ),
        (
            lambda: numscope.quantize(X, "fp8_e4m3", rounding="up"),
            ValueError,
            "unknown rounding 'up'; allowed: nearest, nearest_away, stochastic, zero",
        ),
        (
            lambda: numscope.quantize(X, "fp8_e4m3", overflow="wrap"),
            ValueError,
            "unknown overflow 'wrap'; allowed: saturate, propagate",
        ),
        (
            lambda: numscope.quantize(torch.ones(3, dtype=torch.int32), "fp8_e4m3"),
            TypeError,
            "quantize expects a floating-point tensor, got dtype torch.int32",
        ),
        (
            lambda: numscope.quantize([1.0], "fp8_e4m3"),
            TypeError,
            "quantize expects a torch.Tensor, got list",
        ),
        (
            lambda: numscope.quantize(X, "fp8_e4m3", scaling="delayed"),
            ValueError,
            "delayed scaling keeps an amax history between calls: pass a numscope.DelayedScaler",
        ),
        (
            lambda: numscope.quantize(X, "fp8_e4m3", scaling="block"),
            ValueError,
            "block scaling of the element format 'fp8_e4m3' needs block_shape, e.g. (1, 128)",
        ),
        (
            lambda: numscope.quantize(X, "mxfp8_e4m3", scaling="tensor"),
            ValueError,
            "block format 'mxfp8_e4m3' brings its own block scaling; scaling 'tensor' does not apply",
        ),
        (
            lambda: numscope.encode(X, "nvfp4", scaling="row"),
            ValueError,
            "block format 'nvfp4' brings its own block scaling; scaling 'row' does not apply",
        ),
        (
            lambda: numscope.quantize(X, "mxfp8_e4m3", scaling=Scaling("block", block_shape=(1, 32))),
            ValueError,
            "block format 'mxfp8_e4m3' has a fixed block of 32; drop block_shape",
        ),
        (
            lambda: numscope.quantize(X, "mxfp8_e4m3", scaling=Scaling("block", axis=2)),
            ValueError,
            "block axis 2 is out of range for a tensor of shape (4, 8)",
        ),
        (
            lambda: numscope.quantize(
                torch.ones(8), "fp8_e4m3", scaling=Scaling("block", block_shape=(4, 4))
            ),
            ValueError,
            "block_shape (4, 4) needs a tensor of >= 2 dims, got shape (8,)",
        ),
        (
            lambda: numscope.quantize(X, "fp8_e4m3", scaling="rows"),
            ValueError,
            "unknown scaling 'rows'; allowed: none, tensor, delayed, row, column, block",
        ),
        (
            lambda: numscope.quantize(X, "fp8_e4m3", scaling=3),
            TypeError,
            "scaling must be None, a kind name, a dict or a Scaling, got int",
        ),
        (
            lambda: numscope.quantize(X, "fp8_e4m3", scaling={"kind": "tensor", "margn": 1}),
            ValueError,
            "unknown scaling key(s) ['margn']; allowed:",
        ),
        (
            lambda: Scaling("tensor", margin=0.5),
            TypeError,
            "scaling margin must be an int (binades), got 0.5",
        ),
        (lambda: Scaling("delayed", history_len=0), ValueError, "scaling history_len must be >= 1, got 0"),
        (
            lambda: Scaling("delayed", amax_compute="mean"),
            ValueError,
            "unknown amax_compute 'mean'; allowed: max, most_recent",
        ),
        (
            lambda: Scaling("tensor", block_shape=(1, 128)),
            ValueError,
            "block_shape (1, 128) given for scaling kind 'tensor'; use kind='block'",
        ),
        (
            lambda: Scaling("block", block_shape=(0, 128)),
            ValueError,
            "block_shape must be (N,) or (M, N) of positive ints, got (0, 128)",
        ),
        (
            lambda: numscope.encode(torch.tensor([float("nan")]), "int8"),
            ValueError,
            "int8 has no code for NaN; the input holds NaN",
        ),
        (
            lambda: numscope.encode(X, "fp8_e4m3", scaling=Scaling("block", block_shape=(1, 4))),
            ValueError,
            "encode does not support tile (block_shape) scaling of element formats; use quantize",
        ),
        (
            lambda: DelayedScaler(Scaling("delayed", history_len=4)).load_state_dict(
                DelayedScaler().state_dict()
            ),
            ValueError,
            "amax history of length 16 does not fit history_len 4",
        ),
        (lambda: set_fast("yes"), TypeError, "set_fast expects True or False, got 'yes'"),
        (
            lambda: numscope.FloatFormat("bad", 9, 2),
            ValueError,
            "format 'bad': exponent_bits must be in 1..8, got 9",
        ),
        (
            lambda: get_format("mxfp8").with_scale_rule("round"),
            ValueError,
            "scale_rule must be one of 'floor', 'rceil', 'ceil', 'even', got 'round'",
        ),
    ],
)
def test_error_message(call, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


@pytest.mark.parametrize("name", ["fp9", "float8_e4m3", "bfloat8", "halff"])
def test_an_unknown_format_suggests_each_near_format_once_by_its_own_name(name: str) -> None:
    with pytest.raises(ValueError, match="did you mean") as error:
        get_format(name)
    suggested = re.findall(r"'([^']+)'", str(error.value).split("did you mean", 1)[1].split("?", 1)[0])
    assert suggested and len(suggested) == len(set(suggested))  # 'fp9' offered 'fp32' twice (an alias)
    assert all(get_format(s).name == s for s in suggested)


def test_get_format_is_the_name_and_format_stays_an_alias_kept_out_of_star_imports() -> None:
    assert numscope.get_format("fp8_e4m3").max == 448.0
    assert numscope.format is numscope.get_format  # the first public name still works
    assert "get_format" in numscope.__all__ and "format" not in numscope.__all__
    namespace: dict = {}
    exec("from numscope import *", namespace)
    assert "format" not in namespace and namespace["get_format"] is numscope.get_format
    exec("from numscope.formats import *", namespace)
    assert "format" not in namespace
