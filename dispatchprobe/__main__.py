"""``python -m dispatchprobe ...``: the command line, also under ``torchrun -m dispatchprobe``."""

import sys

from .cli import main

sys.exit(main())
