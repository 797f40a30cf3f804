"""Number formats, their exact casts, scaling schemes and fake-quantization."""

from numscope.formats.quantize import Encoded, encode, quantize
from numscope.formats.scaling import DelayedScaler, Scaling
from numscope.formats.spec import BlockFormat, FloatFormat, Format, IntFormat, format, formats

__all__ = [
    "BlockFormat",
    "DelayedScaler",
    "Encoded",
    "FloatFormat",
    "Format",
    "IntFormat",
    "Scaling",
    "encode",
    "format",
    "formats",
    "quantize",
]
