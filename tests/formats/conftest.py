"""Fixtures of the format tests."""

from __future__ import annotations

import pytest

from numscope.formats import native_enabled, set_native


@pytest.fixture(params=["native", "eager"])
def quantizer_path(request):
    """Runs a test twice: through the native quantizers (numscope's default) and through the eager
    reference (native off), so that both are checked against the references (ml_dtypes, the spec texts)."""
    before = native_enabled()
    set_native(request.param == "native")
    yield request.param
    set_native(before)
