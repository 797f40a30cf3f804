"""Number formats, their exact casts, scaling schemes and fake-quantization."""

from numscope._callable import make_callable as _make_callable
from numscope.formats.fast import fast_enabled, set_fast
from numscope.formats.native import native_enabled, set_native
from numscope.formats.quantize import Encoded, encode, quantize
from numscope.formats.scaling import DelayedScaler, Scaling
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat, formats, get_format
from numscope.formats.spec import format as format  # get_format's first name, kept (not in __all__)

__all__ = [
    "BlockFormat",
    "DelayedScaler",
    "Encoded",
    "FloatFormat",
    "Format",
    "IntFormat",
    "Scaling",
    "encode",
    "fast_enabled",
    "formats",
    "get_format",
    "native_enabled",
    "quantize",
    "set_fast",
    "set_native",
]


_make_callable(__name__, "formats")  # numscope.formats() lists every format
