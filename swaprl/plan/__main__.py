"""`python -m swaprl.plan ...`: the same as `swaprl plan ...`."""

import sys

from .cli import main

sys.exit(main())
