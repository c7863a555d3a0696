"""Entry point of `python -m specflash`."""

import sys

from .cli import main

sys.exit(main())
