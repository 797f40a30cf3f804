"""``python -m numscope.cli``: the command line (as torchrun launches it)."""

import sys

from numscope.cli import main

sys.exit(main())
