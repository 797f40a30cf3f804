"""Number formats, their exact casts, scaling schemes and fake-quantization."""

import sys
import types

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


class _FormatsModule(types.ModuleType):
    """``numscope.formats`` is both this package and the function that lists the formats.

    The package attribute of ``numscope`` named ``formats`` is bound to this module as soon as any of its
    submodules is imported, which would shadow the public function ``numscope.formats()``; calling the
    module therefore lists the formats, so both spellings work.
    """

    def __call__(self) -> list[Format]:
        return formats()


sys.modules[__name__].__class__ = _FormatsModule
